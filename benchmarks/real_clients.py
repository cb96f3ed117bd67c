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

Each client is run with the interpreter given by ``--python`` (default: this one), which must
import the client's packages and ampkit; it also writes run_mlm.py's tokenizer (with tokenizers and
transformers), so this script's own interpreter needs only the standard library, plus numpy and
Pillow for timm's images.
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
        plain_s, plain_rc, plain_out = _run(client, [python, str(client.script), *client.args],
                                            work / f"{client.name}-plain-{i}.log")
        report = work / f"{client.name}-doctor-{i}.json"
        doctor_s, doctor_rc, doctor_out = _run(
            client,
            [python, "-m", "ampkit.cli.main", "doctor", "--json", str(report), str(client.script), *client.args],
            work / f"{client.name}-doctor-{i}.log")
        client.plain_s.append(plain_s)
        client.doctor_s.append(doctor_s)
        findings = json.loads(report.read_text())["findings"] if report.exists() else None
        analysis = [float(m) for m in re.findall(r"ampkit doctor: the script ended after .* \((\d+) s\)", doctor_out)]
        client.results = {
            "plain_exit": plain_rc, "doctor_exit": doctor_rc,
            "findings": sorted({f"{f['severity']} {f['code']}" for f in findings}) if findings is not None else None,
            "last_loss_plain": _last_loss(plain_out), "last_loss_doctor": _last_loss(doctor_out),
            "analysis_progress_s": analysis[-1] if analysis else None,
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
        _text(work / "lightning" / "data" / "wikitext-2.txt", lines=args.lightning_lines)
        env = {"PL_TRAINER_PRECISION": "bf16-mixed", "PL_TRAINER_ACCELERATOR": "cpu",
               "PL_TRAINER_LIMIT_TRAIN_BATCHES": "8", "PL_TRAINER_LIMIT_VAL_BATCHES": "2",
               "PL_TRAINER_LIMIT_TEST_BATCHES": "2"}
        clients.append(Client("lightning", Path(args.lightning_example).resolve(), [], work / "lightning", env))
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
    return clients


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timm-train", help="timm's train.py")
    p.add_argument("--timm-model", default="resnet50")
    p.add_argument("--timm-epochs", type=int, default=1)
    p.add_argument("--timm-img-size", type=int, default=128)
    p.add_argument("--lightning-example", help="Lightning's examples/pytorch/basics/transformer.py")
    p.add_argument("--lightning-lines", type=int, default=13000,
                   help="lines of the local wikitext-2.txt (the example splits off 4000 blocks of 35 words)")
    p.add_argument("--hf-run-mlm", help="transformers' examples/pytorch/language-modeling/run_mlm.py")
    p.add_argument("--mlm-lines", type=int, default=1000, help="lines of the local train.txt for run_mlm.py")
    p.add_argument("--mlm-steps", type=int, default=16)
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
            p.error("name at least one client: --timm-train, --lightning-example or --hf-run-mlm")
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
