"""The real-client check: training scripts that ampkit did not write, run unmodified under the doctor.

Each client runs twice plain and twice under ``ampkit doctor --json`` (alternating, so machine
load drifts hit both alike) on tiny local data that this script writes; it reports each wall
time, the ratio of the medians, both exit statuses, the finding codes, whether the doctor's
run printed the same last loss as the plain run, and how long the doctor's end-of-run analysis
took (from its progress line, when it printed one).  Not part of ``make test``: it needs the
clients' own code and packages, which the project does not install.  docs/real-clients.md
has the exact set-up commands.

    python benchmarks/real_clients.py --timm-train PATH/train.py [--timm-model resnet50 --timm-epochs 1]
    python benchmarks/real_clients.py --lightning-example PATH/examples/pytorch/basics/transformer.py
    python benchmarks/real_clients.py --hf-run-mlm PATH/examples/pytorch/language-modeling/run_mlm.py
    python benchmarks/real_clients.py --accelerate [--accelerate-precisions fp16,bf16,launch-fp16]

Each client is run with the interpreter given by ``--python`` (default: this one), which must
import the client's packages and ampkit; it also writes run_mlm.py's tokenizer (with tokenizers and
transformers), so this script's own interpreter needs only the standard library, plus numpy and
Pillow for timm's images.  The Accelerate client is a script of this check (``ACCELERATE_NLP``,
written to the work folder): accelerate's ``nlp_example.py`` needs a hub model and dataset.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

LOSS = re.compile(r"[Ll]oss[\"']?\s*[:=│]\s*[\"']?([0-9]+\.[0-9]+)")
"""The last loss a client prints (timm's "Loss: 1.14 (1.26)", Lightning's results table, the
"train_loss = 5.43" line of the HF Trainer's closing metrics, after its {'loss': 5.43, ...} logs)."""


@dataclass
class Client:
    name: str
    script: Path
    args: list[str]
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)
    fresh: list[Path] = field(default_factory=list)
    launcher: list[str] = field(default_factory=list)
    """Arguments between the interpreter and the script, in both runs (``-m accelerate.commands.launch ...``):
    the doctor runs as ``-m ampkit.cli.main doctor ...`` after them."""
    """Folders removed before each run (caches that would spare the later runs work)."""
    plain_s: list[float] = field(default_factory=list)
    doctor_s: list[float] = field(default_factory=list)
    results: dict[str, object] = field(default_factory=dict)


def _run(client: Client, cmd: list[str], log: Path) -> tuple[float, int, str]:
    for folder in client.fresh:
        shutil.rmtree(folder, ignore_errors=True)
    start = time.perf_counter()
    with log.open("w") as out:
        rc = subprocess.run(cmd, cwd=client.cwd, env={**os.environ, **client.env}, stdout=out,
                            stderr=subprocess.STDOUT, check=False).returncode
    return time.perf_counter() - start, rc, log.read_text(errors="replace")


def _last_loss(text: str) -> str | None:
    found = LOSS.findall(text)
    return found[-1] if found else None


def _measure(client: Client, python: str, work: Path, rounds: int) -> None:
    for i in range(rounds):
        plain_s, plain_rc, plain_out = _run(client, [python, *client.launcher, str(client.script), *client.args],
                                            work / f"{client.name}-plain-{i}.log")
        report = work / f"{client.name}-doctor-{i}.json"
        doctor_s, doctor_rc, doctor_out = _run(
            client,
            [python, *client.launcher, "-m", "ampkit.cli.main", "doctor", "--json", str(report), str(client.script),
             *client.args],
            work / f"{client.name}-doctor-{i}.log")
        client.plain_s.append(plain_s)
        client.doctor_s.append(doctor_s)
        doc = json.loads(report.read_text()) if report.exists() else None
        findings = doc["findings"] if doc is not None else None
        analysis = [float(m) for m in re.findall(r"ampkit doctor: the script ended after .* \((\d+) s\)", doctor_out)]
        client.results = {
            "plain_exit": plain_rc, "doctor_exit": doctor_rc,
            "findings": sorted({f"{f['severity']} {f['code']}" for f in findings}) if findings is not None else None,
            "last_loss_plain": _last_loss(plain_out), "last_loss_doctor": _last_loss(doctor_out),
            "analysis_progress_s": analysis[-1] if analysis else None,
            "trained_in": (doc["mixed_precision"]["actual"].get("autocast_dtypes") or doc["mixed_precision"]["actual"]
                           ["trained_in"]) if doc is not None and "mixed_precision" in doc else None,
            "mixed_precision_off": [f["message"].split(": ", 1)[0] for f in findings or ()
                                    if f["code"] == "MIXED_PRECISION_OFF"],
        }


# -- tiny local data, written here so that no client downloads anything -------------------------
def _image_folder(root: Path, classes: int = 4, train: int = 16, val: int = 4, size: int = 64) -> Path:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", train), ("validation", val)):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                pixels = (rng.random((size, size, 3)) * 60 + c * 50).clip(0, 255).astype("uint8")
                Image.fromarray(pixels).save(folder / f"{i}.png")
    return root


def _text(path: Path, lines: int, seed: int = 0) -> Path:
    import random

    rng = random.Random(seed)
    words = [f"w{i}" for i in range(200)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(lines)) + "\n")
    return path


_WORDPIECE = """
import os, sys
from tokenizers import BertWordPieceTokenizer
from transformers import BertTokenizerFast
corpus, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
wordpiece = BertWordPieceTokenizer(lowercase=True)
wordpiece.train([corpus], vocab_size=512, min_frequency=1, special_tokens=special, show_progress=False)
# The trainer orders tokens of equal count differently from run to run: sorted, the ids (and so
# the losses) are the same in every run of the check.
tokens = special + sorted(set(wordpiece.get_vocab()) - set(special))
vocab = os.path.join(out, "vocab.txt")
with open(vocab, "w") as f:
    f.write("\\n".join(tokens) + "\\n")
tokenizer = BertTokenizerFast(vocab_file=vocab, model_max_length=128)
tokenizer.save_pretrained(out)
print(len(tokenizer))
"""


def _wordpiece_tokenizer(python: str, corpus: Path, out: Path) -> int:
    """Train a WordPiece vocabulary on ``corpus`` and save it as a BertTokenizerFast folder; its size.

    It needs tokenizers and transformers, so it runs with the clients' interpreter, not this one."""
    done = subprocess.run([python, "-c", _WORDPIECE, str(corpus), str(out)], capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"writing the tokenizer with {python} failed:\n{done.stderr}")
    return int(done.stdout.split()[-1])


ACCELERATE_NLP = '''"""accelerate's examples/nlp_example.py, shrunk to run offline: the same Accelerator calls (the
mixed_precision and cpu arguments, set_seed, prepare, accelerator.backward, gather_for_metrics,
accelerator.print), with a 2-layer transformer encoder in place of bert-base-cased and random
sentence pairs labelled by a rule in place of GLUE MRPC."""
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accelerate import Accelerator
from accelerate.utils import set_seed

VOCAB, SEQ = 512, 32


class PairClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 2)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.encoder(self.embed(input_ids)).mean(1))
        return (None if labels is None else nn.functional.cross_entropy(logits, labels)), logits


def get_dataloaders(batch_size):
    g = torch.Generator().manual_seed(0)

    def split(n):
        x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        return TensorDataset(x, (x[:, : SEQ // 2].sum(1) > x[:, SEQ // 2 :].sum(1)).long())

    return (DataLoader(split(512), shuffle=True, batch_size=batch_size, generator=g),
            DataLoader(split(128), shuffle=False, batch_size=32))


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    lr, num_epochs, seed, batch_size = config["lr"], config["num_epochs"], config["seed"], config["batch_size"]
    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(batch_size)
    model = PairClassifier()
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.01, total_iters=len(train_dataloader) * num_epochs)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    for epoch in range(num_epochs):
        model.train()
        for input_ids, labels in train_dataloader:
            loss, _ = model(input_ids, labels)
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        model.eval()
        correct = total = 0
        for input_ids, labels in eval_dataloader:
            with torch.no_grad():
                _, logits = model(input_ids)
            predictions, references = accelerator.gather_for_metrics((logits.argmax(dim=-1), labels))
            correct += (predictions == references).sum().item()
            total += references.numel()
        accelerator.print(f"epoch {epoch}: loss: {loss.item():.4f} accuracy: {correct / total:.4f}")


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    args = parser.parse_args()
    training_function({"lr": 2e-3, "num_epochs": 3, "seed": 42, "batch_size": 16}, args)


if __name__ == "__main__":
    main()
'''
"""The Accelerate client's script (see the module docstring)."""


def _accelerate_clients(precisions: list[str], work: Path) -> list[Client]:
    """One client per precision: ``fp16``/``bf16`` run ``--mixed_precision P --cpu``; ``launch-P`` runs the script
    through ``accelerate launch --config_file`` with a config file that asks for P (the doctor under the launcher,
    which hands the request to the script as ACCELERATE_MIXED_PRECISION)."""
    folder = work / "accelerate"
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nlp_example_offline.py"
    script.write_text(ACCELERATE_NLP)
    # A fresh HF_HOME: a default_config.yaml of the user's must not change the direct runs.
    env = {"HF_HOME": str(folder / "hf-home")}
    clients = []
    for precision in precisions:
        if precision.startswith("launch-"):
            config = folder / f"{precision}.yaml"
            config.write_text(f"compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nmixed_precision: "
                              f"{precision.removeprefix('launch-')}\nnum_machines: 1\nnum_processes: 1\nuse_cpu: true\n")
            clients.append(Client(f"accelerate-{precision}", script, ["--cpu"], folder, env,
                                  launcher=["-m", "accelerate.commands.launch", "--config_file", str(config)]))
        else:
            clients.append(Client(f"accelerate-{precision}", script, ["--mixed_precision", precision, "--cpu"], folder,
                                  env))
    return clients


def _clients(args: argparse.Namespace, work: Path) -> list[Client]:
    clients = []
    if args.timm_train:
        data = _image_folder(work / "images")
        clients.append(Client("timm", Path(args.timm_train).resolve(), [
            "--data-dir", str(data), "--model", args.timm_model, "--num-classes", "4", "-b", "8",
            "--epochs", str(args.timm_epochs), "--amp", "--amp-dtype", "bfloat16", "--img-size", str(args.timm_img_size),
            "-j", "0", "--device", "cpu", "--output", str(work / "timm-out"), "--log-interval", "4",
            "--warmup-epochs", "0", "--no-prefetcher"], work))
    if args.lightning_example:
        # The example reads ./data/wikitext-2.txt and downloads it only when missing.  Its Trainer takes
        # the arguments the code does not pass from PL_TRAINER_* variables: the precision and a few
        # batches per epoch (it asks for 20 epochs).
        # "16-mixed" on a CPU: Lightning runs bf16 instead, which the doctor reports (MIXED_PRECISION_OFF).
        _text(work / "lightning" / "data" / "wikitext-2.txt", lines=args.lightning_lines)
        for precision in args.lightning_precisions.split(","):
            env = {"PL_TRAINER_PRECISION": precision, "PL_TRAINER_ACCELERATOR": "cpu",
                   "PL_TRAINER_LIMIT_TRAIN_BATCHES": "8", "PL_TRAINER_LIMIT_VAL_BATCHES": "2",
                   "PL_TRAINER_LIMIT_TEST_BATCHES": "2"}
            name = "lightning" if precision == "bf16-mixed" else f"lightning-{precision}"
            clients.append(Client(name, Path(args.lightning_example).resolve(), [], work / "lightning", env))
    if args.hf_run_mlm:
        # BERT from scratch: the model from a config (no --model_name_or_path), the tokenizer a local
        # folder, the data two text files; nothing comes from the hub, which HF_HUB_OFFLINE makes it
        # skip.  No --do_eval: its metric is loaded from the hub.  The datasets cache is emptied before
        # each run so that every run converts and tokenizes the text alike.
        mlm = work / "mlm"
        train = _text(mlm / "train.txt", lines=args.mlm_lines)
        val = _text(mlm / "val.txt", lines=max(args.mlm_lines // 10, 1), seed=1)
        vocab = _wordpiece_tokenizer(args.python, train, mlm / "tokenizer")
        overrides = (f"hidden_size=64,num_hidden_layers=2,num_attention_heads=2,intermediate_size=128,"
                     f"max_position_embeddings=128,vocab_size={vocab}")
        env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(mlm / "datasets-cache")}
        clients.append(Client("hf-run-mlm", Path(args.hf_run_mlm).resolve(), [
            "--model_type", "bert", "--config_overrides", overrides, "--tokenizer_name", str(mlm / "tokenizer"),
            "--train_file", str(train), "--validation_file", str(val), "--do_train",
            "--max_steps", str(args.mlm_steps), "--per_device_train_batch_size", "8", "--max_seq_length", "64",
            "--output_dir", str(mlm / "out"), "--overwrite_output_dir", "--bf16", "--use_cpu",
            "--logging_steps", "4", "--report_to", "none", "--save_strategy", "no", "--seed", "0"],
            mlm, env, fresh=[mlm / "datasets-cache", mlm / "out"]))
    if args.accelerate:
        clients.extend(_accelerate_clients(args.accelerate_precisions.split(","), work))
    return clients


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timm-train", help="timm's train.py")
    p.add_argument("--timm-model", default="resnet50")
    p.add_argument("--timm-epochs", type=int, default=1)
    p.add_argument("--timm-img-size", type=int, default=128)
    p.add_argument("--lightning-example", help="Lightning's examples/pytorch/basics/transformer.py")
    p.add_argument("--lightning-precisions", default="bf16-mixed,16-mixed",
                   help="PL_TRAINER_PRECISION of each Lightning client (one client each)")
    p.add_argument("--lightning-lines", type=int, default=13000,
                   help="lines of the local wikitext-2.txt (the example splits off 4000 blocks of 35 words)")
    p.add_argument("--hf-run-mlm", help="transformers' examples/pytorch/language-modeling/run_mlm.py")
    p.add_argument("--mlm-lines", type=int, default=1000, help="lines of the local train.txt for run_mlm.py")
    p.add_argument("--mlm-steps", type=int, default=16)
    p.add_argument("--accelerate", action="store_true",
                   help="the Accelerate client: an offline nlp_example.py (written by this check) on the CPU")
    p.add_argument("--accelerate-precisions", default="fp16,bf16,launch-fp16",
                   help="fp16/bf16: --mixed_precision P --cpu; launch-P: accelerate launch --config_file asking for P")
    p.add_argument("--rounds", type=int, default=3,
                   help="plain and doctor runs per client, alternating; one round of timm varies from 1.29x to "
                        "1.54x on a quiet 2-core machine, the ratio of the medians of three stays within 1.34-1.40x")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--work", help="folder for the data and logs (default: a temporary one)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        clients = _clients(args, work)
        if not clients:
            p.error("name at least one client: --timm-train, --lightning-example, --hf-run-mlm or --accelerate")
        for client in clients:
            _measure(client, args.python, work, args.rounds)
            plain, doctor = statistics.median(client.plain_s), statistics.median(client.doctor_s)
            print(f"== {client.name}: plain {plain:.1f} s, doctor {doctor:.1f} s, ratio {doctor / plain:.2f}x "
                  f"(plain {[round(t, 1) for t in client.plain_s]}, doctor {[round(t, 1) for t in client.doctor_s]})")
            for key, value in client.results.items():
                print(f"   {key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
