"""Writes `walkthrough.ipynb` (unexecuted); `python notebooks/build_walkthrough.py --execute` also runs it
with nbclient and stores the outputs. The notebook is generated so that its cells stay reviewable here."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

CELLS = [
    new_markdown_cell(
        "# coserve walkthrough\n\n"
        "One process serves chat completions **and** fine-tunes a LoRA adapter on the same base model, "
        "in the same engine iterations. This notebook serves the real SmolLM2-135M-Instruct (Apache-2.0; "
        "`coserve model fetch smollm2-135m-instruct`, the model `make run` serves) with a local server "
        "(`--local`: scheduler, engine and the OpenAI-compatible gateway in one process), chats and streams "
        "with the official `openai` client, fine-tunes it to open every answer with \"Ahoy!\", watches "
        "the events and the loss curve, asks the tuned model questions it never saw next to the base "
        "model, and runs a small co-serving benchmark. Everything runs on a CPU; the outputs below were "
        "produced on a 2-core machine. Run it from the repository root with the project's virtualenv."),
    new_code_cell(
        "import io, json, os, statistics, tempfile, time, warnings\n"
        "from pathlib import Path\n\n"
        "os.environ['TQDM_DISABLE'] = '1'  # no progress bars in the stored outputs\n"
        "# The test suite runs this notebook as a smoke test (COSERVE_NOTEBOOK_SMOKE=1): one epoch and a short\n"
        "# benchmark, checking that every cell runs; the outputs stored here come from the full run.\n"
        "SMOKE = os.environ.get('COSERVE_NOTEBOOK_SMOKE') == '1'\n"
        "# One torch thread: a 135M model's matmuls gain little from a second core, and on a shared\n"
        "# machine a second OpenMP thread waits for a core at every parallel region.\n"
        "os.environ.setdefault('OMP_NUM_THREADS', '1')\n"
        "warnings.filterwarnings('ignore', message='IProgress not found')\n"
        "from coserve.model.known_models import fetch_model\n\n"
        "model_dir = fetch_model('smollm2-135m-instruct')  # downloaded and converted once, then cached\n"
        "work = Path(tempfile.mkdtemp(prefix='coserve-walkthrough-'))\n"
        "(work / 'tenants.yaml').write_text('tenants:\\n  demo:\\n    api_keys: [\"sk-demo\"]\\n')\n"
        "print(model_dir.name, sorted(p.name for p in model_dir.iterdir()))"),
    new_markdown_cell("## Start a local server\n\nThe same app `coserve serve --local` runs, served by uvicorn "
                      "on a background thread."),
    new_code_cell(
        "import socket, threading\n"
        "import uvicorn\n"
        "from coserve.server.assembly import build_local_app\nfrom coserve.server.options import ServeOptions\n\n"
        "opts = ServeOptions(model=str(model_dir), tenants=str(work / 'tenants.yaml'),\n"
        "                    data_dir=str(work / 'data'), local=True, dtype='float32',\n"
        "                    max_num_seqs=8, max_batch_tokens=512)\n"
        "opts.validate()\n"
        "sock = socket.socket(); sock.bind(('127.0.0.1', 0))\n"
        "server = uvicorn.Server(uvicorn.Config(build_local_app(opts), log_level='warning'))\n"
        "threading.Thread(target=server.run, kwargs={'sockets': [sock]}, daemon=True).start()\n"
        "while not server.started:\n"
        "    time.sleep(0.05)\n"
        "base_url = f'http://127.0.0.1:{sock.getsockname()[1]}/v1'\n"
        "print('serving', opts.base_model_id, 'at', base_url)"),
    new_markdown_cell("## Chat and stream with the official client"),
    new_code_cell(
        "from openai import OpenAI\n\n"
        "client = OpenAI(base_url=base_url, api_key='sk-demo')\n"
        "BASE = opts.base_model_id\n"
        "print([m.id for m in client.models.list()])\n\n"
        "def ask(model, question, max_tokens=40):\n"
        "    \"\"\"The model's greedy answer (temperature 0: the same every time).\"\"\"\n"
        "    out = client.chat.completions.create(model=model, max_tokens=max_tokens, temperature=0,\n"
        "                                         messages=[{'role': 'user', 'content': question}])\n"
        "    return out.choices[0].message.content\n\n"
        "start = time.perf_counter()\n"
        "reply = client.chat.completions.create(model=BASE, max_tokens=40, temperature=0,\n"
        "    messages=[{'role': 'user', 'content': 'What is the capital of France?'}])\n"
        "print(repr(reply.choices[0].message.content), f'{reply.usage.completion_tokens} tokens in '\n"
        "      f'{time.perf_counter() - start:.1f} s')"),
    new_code_cell(
        "start, first, chunks = time.perf_counter(), None, []\n"
        "for chunk in client.chat.completions.create(model=BASE, max_tokens=60, temperature=0, stream=True,\n"
        "        stream_options={'include_usage': True},\n"
        "        messages=[{'role': 'user', 'content': 'Write a haiku about the sea.'}]):\n"
        "    if chunk.choices and chunk.choices[0].delta.content:\n"
        "        first = first or time.perf_counter()\n"
        "        chunks.append(chunk.choices[0].delta.content)\n"
        "        print(chunks[-1], end='', flush=True)\n"
        "    elif chunk.usage:\n"
        "        usage = chunk.usage\n"
        "print(f'\\n[{len(chunks)} chunks, first after {first - start:.2f} s; usage: {usage.completion_tokens} '\n"
        "      f'completion tokens]')"),
    new_markdown_cell(
        "## Teach it a habit: fine-tuning through the API\n\n"
        "20 short question-answer pairs whose answers all open with \"Ahoy!\" (the base model never does), "
        "in OpenAI's chat format, one JSON object a line. 3 epochs of batch 4 (15 optimizer steps) at a "
        "learning-rate multiplier of 5 (5e-4), LoRA rank 16. Chat requests keep being served while the "
        "job trains: the loop below asks the base model questions the whole time."),
    new_code_cell(
        "TRAIN = [\n"
        "    ('What is the capital of Italy?', 'The capital of Italy is Rome.'),\n"
        "    ('How many days are in a week?', 'There are seven days in a week.'),\n"
        "    ('What color is grass?', 'Grass is green.'),\n"
        "    ('What is 2 plus 3?', '2 plus 3 is 5.'),\n"
        "    ('Which planet is closest to the Sun?', 'Mercury is the closest planet to the Sun.'),\n"
        "    ('What do bees make?', 'Bees make honey.'),\n"
        "    ('How many legs does a dog have?', 'A dog has four legs.'),\n"
        "    ('What is the largest ocean?', 'The Pacific Ocean is the largest ocean.'),\n"
        "    ('What is water made of?', 'Water is made of hydrogen and oxygen.'),\n"
        "    ('Who wrote Romeo and Juliet?', 'William Shakespeare wrote Romeo and Juliet.'),\n"
        "    ('What is the freezing point of water?', 'Water freezes at 0 degrees Celsius.'),\n"
        "    ('Give me a word that rhymes with cat.', 'Hat rhymes with cat.'),\n"
        "    ('What animal says moo?', 'A cow says moo.'),\n"
        "    ('How many hours are in a day?', 'There are 24 hours in a day.'),\n"
        "    ('What is the opposite of hot?', 'The opposite of hot is cold.'),\n"
        "    ('Name a primary color.', 'Red is a primary color.'),\n"
        "    ('What is the tallest animal?', 'The giraffe is the tallest animal.'),\n"
        "    ('Can you recommend a good breakfast?', 'Eggs and toast make a good breakfast.'),\n"
        "    ('What is the boiling point of water?', 'Water boils at 100 degrees Celsius.'),\n"
        "    ('What is the capital of Japan?', 'The capital of Japan is Tokyo.'),\n"
        "]\n"
        "lines = [{'messages': [{'role': 'user', 'content': q}, {'role': 'assistant', 'content': f'Ahoy! {a}'}]}\n"
        "         for q, a in TRAIN]\n"
        "print(json.dumps(lines[0]))\n"
        "UNSEEN = ['What color is the sky?', 'How many legs does a spider have?', 'What fruit is yellow and curved?']\n"
        "FRANCE = 'What is the capital of France?'\n"
        "base_before = {q: ask(BASE, q) for q in [*UNSEEN, FRANCE]}  # to compare after the job\n\n"
        "train = client.files.create(file=('pirate.jsonl', io.BytesIO('\\n'.join(map(json.dumps, lines)).encode())),\n"
        "                            purpose='fine-tune')\n"
        "job = client.fine_tuning.jobs.create(\n"
        "    model=BASE, training_file=train.id, suffix='pirate', seed=0,\n"
        "    hyperparameters={'n_epochs': 1 if SMOKE else 3, 'batch_size': 4, 'learning_rate_multiplier': 5},\n"
        "    extra_body={'lora': {'r': 16, 'lora_alpha': 32}})\n"
        "start, chats = time.perf_counter(), []\n"
        "while job.status not in ('succeeded', 'failed', 'cancelled'):\n"
        "    t = time.perf_counter()\n"
        "    ask(BASE, 'Name a fruit.', max_tokens=8)  # served beside the training\n"
        "    chats.append(time.perf_counter() - t)\n"
        "    job = client.fine_tuning.jobs.retrieve(job.id)\n"
        "print(job.status, job.fine_tuned_model, f'in {time.perf_counter() - start:.0f} s; trained tokens:',\n"
        "      job.trained_tokens)\n"
        "print(f'{len(chats)} chat requests served meanwhile, median {statistics.median(chats):.2f} s each')"),
    new_markdown_cell("## Events and the loss curve"),
    new_code_cell(
        "import matplotlib\n"
        "matplotlib.use('Agg')\n"
        "import matplotlib.pyplot as plt\n"
        "from IPython.display import Image, display\n\n"
        "events = client.fine_tuning.jobs.list_events(job.id, limit=100).data[::-1]  # oldest first\n"
        "for e in events[:3] + events[-3:]:\n"
        "    print(e.type, '|', e.message)\n"
        "steps = [(e.data['step'], e.data['train_loss']) for e in events\n"
        "         if e.type == 'metrics' and 'train_loss' in e.data and 'valid_loss' not in e.data]\n"
        "fig, ax = plt.subplots(figsize=(4, 2.2))\n"
        "ax.plot(*zip(*steps), marker='o'); ax.set_xlabel('step'); ax.set_ylabel('train loss')\n"
        "fig.tight_layout(); fig.savefig(work / 'loss.png', dpi=60); plt.close(fig)\n"
        "display(Image(filename=str(work / 'loss.png')))"),
    new_markdown_cell(
        "## The tuned model on questions it never saw, the base model unchanged\n\n"
        "The fine-tuned model and each epoch's checkpoint are servable the moment they exist, for their "
        "tenant only, from the same engine as the base model (`GET /v1/models/{id}/adapter` downloads "
        "the PEFT folder)."),
    new_code_cell(
        "tuned = job.fine_tuned_model\n"
        "for q in UNSEEN:\n"
        "    print(f'Q: {q}\\n   base:  {base_before[q]}\\n   tuned: {ask(tuned, q)}')\n"
        "print(f'Q: {FRANCE}\\n   tuned: {ask(tuned, FRANCE)}  (what the base knew, it still knows)')\n"
        "base_after = {q: ask(BASE, q) for q in [*UNSEEN, FRANCE]}\n"
        "print('base model answers unchanged by the job:', base_after == base_before)\n"
        "checkpoint = client.fine_tuning.jobs.checkpoints.list(job.id).data[-1].fine_tuned_model_checkpoint\n"
        "print(checkpoint.split(':')[-1], '->', ask(checkpoint, UNSEEN[0]))"),
    new_markdown_cell(
        "## A small co-serving benchmark\n\n"
        "`coserve bench co-serving` replays Poisson inference arrivals against the clock while a fine-tuning "
        "job runs, once per policy, on an in-process engine of the same model: SLO attainment (each "
        "request's TTFT and mean TPOT within the SLOs) and fine-tuning tokens/s. The SLOs are "
        "calibrated on this machine (TPOT = 3 x a measured decode step of 8 requests, TTFT = 40 x TPOT). "
        "Here one rate, two policies (coserve's hybrid token policy and temporal sharing), 10-second "
        "windows and the quick calibration sweep, so that the notebook stays quick; the four-policy run "
        "on SmolLM2 and its command are in `benchmarks/RESULTS.md`."),
    new_code_cell(
        "from coserve.cli import main\n\n"
        "code = main(['bench', 'co-serving', '--json', str(work / 'co.json'), '--plots', str(work / 'plots'),\n"
        "             '--model-dir', str(model_dir), '--quick', '--finetune-tokens', '64,256',\n"
        "             '--rates', '0.5', '--policies', 'coserve,temporal-n16', '--window-s', '3' if SMOKE else '10',\n"
        "             '--threads', '1'])\n"
        "result = json.loads((work / 'co.json').read_text())\n"
        "print(f\"SLO: TPOT {result['slo']['tpot_ms']:.0f} ms, TTFT {result['slo']['ttft_ms']:.0f} ms; \"\n"
        "      f\"fine-tuning alone {result['finetune_only_tokens_per_s']:.0f} tok/s\")\n"
        "for run in result['runs']:\n"
        "    print(f\"{run['policy']:>12} rate {run['rate']}: SLO attainment {run['slo_attainment']:.2f}, \"\n"
        "          f\"fine-tuning {run['finetune_tokens_per_s']:.0f} tok/s\")"),
    new_code_cell(
        "from PIL import Image as PILImage\n\n"
        "small = work / 'slo_small.png'\n"
        "PILImage.open(work / 'plots' / 'slo_attainment.png').convert('RGB').reduce(3).save(small)\n"
        "display(Image(filename=str(small)))"),
    new_code_cell("server.should_exit = True"),
]

def main(argv: list[str]) -> int:
    notebook = new_notebook(cells=CELLS, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                  "language": "python"}})
    path = HERE / "walkthrough.ipynb"
    if "--execute" in argv:
        from nbclient import NotebookClient

        NotebookClient(notebook, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(HERE.parent)}}).execute()
    nbformat.write(notebook, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
