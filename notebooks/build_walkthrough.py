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
        "in the same engine iterations. This notebook starts a local server (`--local`: scheduler, engine "
        "and the OpenAI-compatible gateway in one process), chats with the official `openai` client, "
        "uploads a training file, fine-tunes, watches the events and the loss curve, chats with the "
        "fine-tuned model, and runs a very small co-serving benchmark.\n\n"
        "The model is a tiny random one (`coserve model create-tiny`), so the text is noise: the point is "
        "the machinery. Run it from the repository root with the project's virtualenv."),
    new_code_cell(
        "import io, json, os, tempfile, time, warnings\n"
        "from pathlib import Path\n\n"
        "os.environ['TQDM_DISABLE'] = '1'  # no progress bars in the stored outputs\n"
        "warnings.filterwarnings('ignore', message='IProgress not found')\n"
        "from coserve.platform.tiny_model import create_tiny_model\n\n"
        "work = Path(tempfile.mkdtemp(prefix='coserve-walkthrough-'))\n"
        "model_dir = create_tiny_model(work / 'tiny-llama', arch='llama', preset='tiny', seed=0)\n"
        "(work / 'tenants.yaml').write_text('tenants:\\n  demo:\\n    api_keys: [\"sk-demo\"]\\n')\n"
        "print(sorted(p.name for p in model_dir.iterdir()))"),
    new_markdown_cell("## Start a local server\n\nThe same app `coserve serve --local` runs, served by uvicorn "
                      "on a background thread."),
    new_code_cell(
        "import socket, threading\n"
        "import uvicorn\n"
        "from coserve.server.assembly import build_local_app\nfrom coserve.server.options import ServeOptions\n\n"
        "opts = ServeOptions(model=str(model_dir), tenants=str(work / 'tenants.yaml'),\n"
        "                    data_dir=str(work / 'data'), local=True, dtype='float32', max_num_seqs=8)\n"
        "opts.validate()\n"
        "sock = socket.socket(); sock.bind(('127.0.0.1', 0))\n"
        "server = uvicorn.Server(uvicorn.Config(build_local_app(opts), log_level='warning'))\n"
        "threading.Thread(target=server.run, kwargs={'sockets': [sock]}, daemon=True).start()\n"
        "while not server.started:\n"
        "    time.sleep(0.05)\n"
        "base_url = f'http://127.0.0.1:{sock.getsockname()[1]}/v1'\n"
        "print('serving', opts.base_model_id, 'at', base_url)"),
    new_markdown_cell("## Chat with the official client"),
    new_code_cell(
        "from openai import OpenAI\n\n"
        "client = OpenAI(base_url=base_url, api_key='sk-demo')\n"
        "print([m.id for m in client.models.list()])\n"
        "reply = client.chat.completions.create(model=opts.base_model_id, max_tokens=12, temperature=0,\n"
        "                                       messages=[{'role': 'user', 'content': 'Hello!'}])\n"
        "print(repr(reply.choices[0].message.content), reply.usage.completion_tokens, 'tokens')"),
    new_markdown_cell("## Upload a training file and fine-tune\n\nOpenAI's chat format, one JSON object a line; "
                      "at least 10 examples. Chat requests keep being served while the job trains."),
    new_code_cell(
        "lines = [{'messages': [{'role': 'user', 'content': f'Say the number {i}'},\n"
        "                       {'role': 'assistant', 'content': f'The number is {i}.'}]} for i in range(12)]\n"
        "data = '\\n'.join(json.dumps(x) for x in lines).encode()\n"
        "train = client.files.create(file=('train.jsonl', io.BytesIO(data)), purpose='fine-tune')\n"
        "job = client.fine_tuning.jobs.create(model=opts.base_model_id, training_file=train.id, suffix='numbers',\n"
        "                                     hyperparameters={'n_epochs': 3, 'batch_size': 4},\n"
        "                                     extra_body={'lora': {'r': 8, 'lora_alpha': 16}})\n"
        "while job.status not in ('succeeded', 'failed', 'cancelled'):\n"
        "    client.chat.completions.create(model=opts.base_model_id, max_tokens=2,\n"
        "                                   messages=[{'role': 'user', 'content': 'ping'}])\n"
        "    time.sleep(0.2)\n"
        "    job = client.fine_tuning.jobs.retrieve(job.id)\n"
        "print(job.status, job.fine_tuned_model, 'trained tokens:', job.trained_tokens)"),
    new_markdown_cell("## Events and the loss curve"),
    new_code_cell(
        "import matplotlib\n"
        "matplotlib.use('Agg')\n"
        "import matplotlib.pyplot as plt\n"
        "from IPython.display import Image, display\n\n"
        "events = client.fine_tuning.jobs.list_events(job.id, limit=100).data[::-1]  # oldest first\n"
        "for e in events[:4] + events[-2:]:\n"
        "    print(e.type, '|', e.message)\n"
        "steps = [(e.data['step'], e.data['train_loss']) for e in events\n"
        "         if e.type == 'metrics' and 'train_loss' in e.data and 'valid_loss' not in e.data]\n"
        "fig, ax = plt.subplots(figsize=(4, 2.2))\n"
        "ax.plot(*zip(*steps), marker='o'); ax.set_xlabel('step'); ax.set_ylabel('train loss')\n"
        "fig.tight_layout(); fig.savefig(work / 'loss.png', dpi=60); plt.close(fig)\n"
        "display(Image(filename=str(work / 'loss.png')))"),
    new_markdown_cell("## Chat with the fine-tuned model and a checkpoint\n\nBoth are servable the moment they exist, "
                      "for their tenant only; `GET /v1/models/{id}/adapter` downloads the PEFT folder."),
    new_code_cell(
        "checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data\n"
        "for model in (job.fine_tuned_model, checkpoints[-1].fine_tuned_model_checkpoint):\n"
        "    out = client.chat.completions.create(model=model, max_tokens=8, temperature=0,\n"
        "                                         messages=[{'role': 'user', 'content': 'Say the number 3'}])\n"
        "    print(model, '->', repr(out.choices[0].message.content))"),
    new_markdown_cell(
        "## A very small co-serving benchmark\n\n"
        "Inference arrivals replayed against the clock while a fine-tuning job runs, once per policy. "
        "Here on the tiny model with a fixed SLO and a 1-second window so the notebook stays quick; the "
        "issue's measurement is `coserve bench co-serving --quick --json OUT --plots DIR` on the `small` "
        "preset (results in `benchmarks/RESULTS.md`)."),
    new_code_cell(
        "from coserve.cli import main\n\n"
        "code = main(['bench', 'co-serving', '--json', str(work / 'co.json'), '--plots', str(work / 'plots'),\n"
        "             '--model-dir', str(model_dir), '--rates', '4,8', '--policies', 'coserve,temporal-n8',\n"
        "             '--window-s', '1', '--threads', '1', '--tpot-slo-ms', '40', '--ttft-slo-ms', '1000'])\n"
        "result = json.loads((work / 'co.json').read_text())\n"
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
