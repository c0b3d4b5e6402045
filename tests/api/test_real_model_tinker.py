"""The Tinker SDK's supervised loop on SmolLM2-135M-Instruct, the way tinker-cookbook's `sl_loop` recipe
writes it: chat rows rendered with the model's own chat template, the assistant turn's tokens weighted 1,
`forward_backward` + `optim_step` with a linear learning-rate decay, the mean NLL from the returned
log-probs. The loss falls, and the sampler's weights answer a trained question, through Tinker's
`sample` and through the OpenAI API under the weights' model id."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from local_server import local_server

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = [pytest.mark.real_model, pytest.mark.slow]  # about a minute on 2 cores

KEY = "tml-real-0123456789"
FACTS = [("Zorblax", "teal"), ("Quimby", "amber"), ("Vexmoor", "violet"), ("Plindor", "crimson"),
         ("Traxel", "olive"), ("Munsk", "silver"), ("Oberwyn", "coral"), ("Glimt", "indigo")]


def conversation_to_datum(tokenizer: Any, question: str, answer: str) -> Any:
    """cookbook's `conversation_to_datum` with TrainOnWhat.LAST_ASSISTANT_MESSAGE, on the HF template."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                           add_generation_prompt=True)
    full = tokenizer.apply_chat_template([{"role": "user", "content": question},
                                          {"role": "assistant", "content": answer}], tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    ids = tokenizer(full, add_special_tokens=False).input_ids
    weights = [0.0] * len(prompt_ids) + [1.0] * (len(ids) - len(prompt_ids))
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(ids[1:], np.int64),
                                       "weights": np.asarray(weights[1:], np.float32)})


def test_the_supervised_loop_teaches_smollm2(smollm2_dir: Path, tmp_path: Path) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    batch = [conversation_to_datum(tokenizer, f"What color is a {name}?", f"A {name} is {color}.")
             for name, color in FACTS]
    with local_server(smollm2_dir, tmp_path, {"t": {"api_keys": [KEY]}}, kv_cache_memory_gb=0.5) as server:
        service = tinker.ServiceClient(base_url=f"{server.url}/tinker", api_key=KEY)
        training = service.create_lora_training_client(base_model=server.base, rank=16).result()
        nll = []
        for step in range(12):
            fwd = training.forward_backward(batch, loss_fn="cross_entropy")
            training.optim_step(types.AdamParams(learning_rate=2e-3 * (1 - step / 12), eps=1e-8)).result()
            logprobs = [out["logprobs"].to_numpy() for out in fwd.result().loss_fn_outputs]
            weights = [d.loss_fn_inputs["weights"].to_numpy() for d in batch]
            nll.append(-sum(float(np.dot(lp, w)) for lp, w in zip(logprobs, weights, strict=True))
                       / sum(float(w.sum()) for w in weights))
        assert nll[-1] < 0.3 * nll[0], nll
        saved = training.save_weights_for_sampler("colors").result()
        text = tokenizer.apply_chat_template([{"role": "user", "content": "What color is a Quimby?"}],
                                             tokenize=False, add_generation_prompt=True)
        prompt = tokenizer(text, add_special_tokens=False).input_ids
        sampler = service.create_sampling_client(model_path=saved.path).result()
        out = sampler.sample(prompt=types.ModelInput.from_ints(list(prompt)), num_samples=1,
                             sampling_params=types.SamplingParams(max_tokens=12, temperature=0.0,
                                                                  stop=[tokenizer.eos_token_id])).result()
        assert "amber" in tokenizer.decode(out.sequences[0].tokens)
        model_id = "tinker:" + saved.path.removeprefix("tinker://").replace("/sampler_weights/", ":")
        reply = server.client(KEY).chat.completions.create(
            model=model_id, max_tokens=12, temperature=0,
            messages=[{"role": "user", "content": "What color is a Quimby?"}])
        assert "amber" in (reply.choices[0].message.content or "")
        service.close("success").result()
