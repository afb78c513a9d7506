"""llama.cpp's runner: `llama-server` with every adapter loaded at start and applied per request.

The job's safetensors model is converted to a GGUF of the job's dtype (bfloat16 or float32), or
of `options.outtype` (f16, q8_0: another weights type), and each PEFT adapter to a GGUF LoRA
(unless it is a .gguf file already), with llama.cpp's own converters; `options.gguf` names a
GGUF to serve instead (the shipped Q4_1 file: what a llama.cpp user runs). The server gets one
slot per request (`-np`), a unified KV cache and continuous batching; every request is posted at
once, each naming its adapter in the `lora` field (the others at scale 0), greedy, EOS ignored,
prompt caches off. llama.cpp batches only requests with the same LoRA configuration together. A
base-model request names the first adapter at scale 0: one that names none runs with the
server's own list, every loaded adapter at scale 0, and all of them are computed (measured: 7
against 259 tok/s for 32 requests with 32 adapters loaded).

    python -m benchmarks.peers.run_llama_cpp JOB RESULT          # a benchmark job (job.py)
    python -m benchmarks.peers.run_llama_cpp serve --model DIR --dtype D --port P --parallel N ADAPTER...
                                                   # convert, then become llama-server (online runs)

Standard library only, as every runner: the converters run in processes of their own.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.peers.job import Generate, Job, JobWorkload, run_job

OUTTYPES = {"bfloat16": "bf16", "float32": "f32"}
CONTEXT_PER_SLOT = 1024  # tokens of KV per request: a chat prompt and its answer
# Every adapter converted in one process: the converter's imports (torch) once, not once each.
CONVERT_ADAPTERS = """
import json, runpy, sys
source, runs = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, source)
for arguments in runs:
    sys.argv = ["convert_lora_to_gguf.py", *arguments]
    runpy.run_path(f"{source}/convert_lora_to_gguf.py", run_name="__main__")
"""


def converter_base(model_dir: Path, work: Path) -> Path:
    """The model's files as the converters (transformers 4) read them: config.json naming the
    architecture, tokenizer_config.json the tokenizer class that transformers 4 knows, and
    tokenizer.json's vocabulary padded to the model's rows. A random checkpoint at a family's real
    shapes carries the embedded model's 49,152-token tokenizer; Gemma 3's converter cuts the
    embedding to the tokenizer's tokens while its vocabulary is padded to config.json's size, and
    llama-server then refused the model (token_embd.weight 49,169 rows, 262,144 expected)."""
    base = work / "base"
    base.mkdir()
    model_config = json.loads((model_dir / "config.json").read_text())
    rows = model_config.get("vocab_size", 0)
    # Phi-3's converter reads a BPE vocabulary only for GPT2Tokenizer (Phi-4's class), else wants tokenizer.model.
    tokenizer_class = "GPT2Tokenizer" if model_config.get("model_type") == "phi3" else "PreTrainedTokenizerFast"
    patched = {
        "config.json": lambda config: config.setdefault("architectures", ["LlamaForCausalLM"]),
        "tokenizer_config.json": lambda config: config.update(tokenizer_class=tokenizer_class),
        "tokenizer.json": lambda tokenizer: pad_vocabulary(tokenizer, rows),
    }
    for file in model_dir.iterdir():
        if file.name in patched:
            config = json.loads(file.read_text())
            patched[file.name](config)
            (base / file.name).write_text(json.dumps(config))
        else:
            (base / file.name).symlink_to(file.resolve())
    return base


def pad_vocabulary(tokenizer: dict, rows: int) -> None:
    """Unused tokens for the ids up to `rows` that neither the vocabulary nor an added token holds
    (they are never produced: tokenization is unchanged)."""
    vocab = tokenizer["model"]["vocab"]
    taken = set(vocab.values()) | {token["id"] for token in tokenizer.get("added_tokens", [])}
    vocab.update({f"<unused_row_{i}>": i for i in range(rows) if i not in taken})


def convert(
    source: Path, model_dir: Path, outtype: str, adapters: dict[str, str], gguf: str | None, work: Path
) -> tuple[Path, list[str]]:
    """The GGUF to serve (weights of `outtype`: f32, bf16, f16 or q8_0) and the adapters' GGUF files, in
    the order given (their ids); adapters of a q8_0 model stay bf16, as ours stay 16-bit over int8."""
    adapter_outtype = "bf16" if outtype == "q8_0" else outtype
    base = converter_base(model_dir, work)
    log = work / "convert.log"
    steps = []
    model = Path(gguf) if gguf else work / f"model-{outtype}.gguf"
    if not gguf:
        steps.append([str(source / "convert_hf_to_gguf.py"), str(base), "--outtype", outtype, "--outfile", str(model)])
    loras, runs = [], []
    for name, path in adapters.items():
        out = Path(path) if path.endswith(".gguf") else work / f"{name}-{adapter_outtype}.gguf"
        if out != Path(path):
            runs.append([path, "--base", str(base), "--outtype", adapter_outtype, "--outfile", str(out)])
        loras.append(str(out))
    if runs:
        steps.append(["-c", CONVERT_ADAPTERS, str(source), json.dumps(runs)])
    print(f"llama.cpp: converting {'the model and ' if not gguf else ''}{len(runs)} adapters (log {log})", flush=True)
    with log.open("w") as out:
        for step in steps:
            if subprocess.run([sys.executable, *step], stdout=out, stderr=subprocess.STDOUT, check=False).returncode:
                raise RuntimeError(f"conversion failed: {' / '.join(log.read_text().splitlines()[-3:])}")
    return model, loras


def server_command(model: Path, loras: list[str], parallel: int, port: int) -> list[str]:
    adapters = ["--lora", ",".join(loras), "--lora-init-without-apply"] if loras else []
    # llama.cpp's AMX buffer type takes no adapters: on a Xeon with AMX its q8_0 server with LoRAs
    # segfaulted at start (llama-cpp-python 0.3.36's tree); --no-repack leaves its weights on the
    # AVX-512 path (AMX repacks only quantized types).
    cpuinfo = Path("/proc/cpuinfo")
    if adapters and cpuinfo.is_file() and " amx_tile" in cpuinfo.read_text():
        adapters.append("--no-repack")
    return [
        os.environ["LLAMA_SERVER"], "-m", str(model), *adapters,
        "-np", str(parallel), "-c", str(parallel * CONTEXT_PER_SLOT), "--kv-unified", "-t", str(os.cpu_count() or 1),
        "--no-webui", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip


def start_server(command: list[str], url: str, log: Path) -> subprocess.Popen:
    server = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            errors = [line for line in log.read_text().splitlines() if " E " in line or "error" in line]
            raise RuntimeError(f"llama-server exited with {server.returncode}: {' / '.join(errors[:2])[:400]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise RuntimeError(f"llama-server did not answer in 300 s: {log.read_text()[-400:]}")


def lora_field(ids: dict[str, int], name: str | None) -> list[dict]:
    """The `lora` of a request for adapter `name` (None: the base model; see the module's note)."""
    if name is None:
        return [{"id": 0, "scale": 0.0}] if ids else []
    return [{"id": ids[name], "scale": 1.0}]


def complete(url: str, prompt: list[int], max_tokens: int, lora: list[dict]) -> list[int]:
    body = {
        "prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "cache_prompt": False, "return_tokens": True, "lora": lora,
    }  # fmt: skip
    request = urllib.request.Request(
        f"{url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=3600) as response:
        return json.loads(response.read())["tokens"]


def setup(job: Job) -> tuple[Generate, str]:
    work = Path(tempfile.mkdtemp(prefix="llama-cpp-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    source = Path(os.environ["LLAMA_CPP_DIR"])
    outtype = job.options.get("outtype") or OUTTYPES[job.dtype]  # a weights type other than the dtype's
    model, loras = convert(source, Path(job.model), outtype, job.adapters, job.options.get("gguf"), work)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    # --cache-ram 0: no host-side prompt cache either, so each timed run computes its prompts.
    command = [*server_command(model, loras, job.max_num_seqs, port), "--cache-ram", "0"]
    server = start_server(command, url, work / "server.log")
    atexit.register(server.terminate)  # registered last: runs first
    ids = {name: index for index, name in enumerate(job.adapters)}
    printed = subprocess.run([os.environ["LLAMA_SERVER"], "--version"], capture_output=True, text=True, check=False)
    version = (printed.stderr + printed.stdout).strip().splitlines()

    def generate(workload: JobWorkload) -> list[list[int]]:
        if server.poll() is not None:
            raise RuntimeError(f"llama-server exited with {server.returncode}")
        requests = [
            (prompt, length, lora_field(ids, name))
            for prompt, length, name in zip(workload.prompts, workload.output_lens, workload.adapters, strict=True)
        ]
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            return list(pool.map(lambda request: complete(url, *request), requests))

    return generate, f"llama.cpp {version[0].removeprefix('version: ') if version else '?'}"


def serve(argv: list[str]) -> None:
    """Convert the model and adapters, then become llama-server (its process, its signals)."""
    parser = argparse.ArgumentParser(prog="run_llama_cpp serve")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--dtype", choices=list(OUTTYPES), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--parallel", type=int, required=True)
    parser.add_argument("--work", type=Path, required=True, help="where the GGUF files go")
    parser.add_argument("adapters", nargs="*", type=Path)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True)
    adapters = {path.name: str(path) for path in args.adapters}
    source = Path(os.environ["LLAMA_CPP_DIR"])
    model, loras = convert(source, args.model, OUTTYPES[args.dtype], adapters, None, args.work)
    command = server_command(model, loras, args.parallel, args.port)
    os.execv(command[0], [*command, "--alias", "base"])


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2:])
    else:
        run_job(setup)
