"""A model as coserve reads it: `config.json`, safetensors weights in the fused layout, the tokenizer the
gateway rebuilds, PEFT adapter folders checked without torch, known real models (`coserve model fetch`),
GGUF import, and the tiny random models of the tests and the demo."""
