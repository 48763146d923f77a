"""python -m kvbook: trace | generate | serve | bench.

Every command takes --config PATH (default ./config.toml) and repeatable --set section.key=value.
A user mistake (bad flag, bad path, bad config) prints one line on stderr and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from ..cache.contiguous import CacheFullError
from ..config import Config, ConfigError, load_config
from ..kernels import enable_huge_pages
from ..model.weights import CheckpointError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + message; one line is enough
        raise ConfigError(f"{message} (see python -m {self.prog} --help)")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="config.toml", help="path to config.toml (default: %(default)s)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config key, e.g. --set kv_cache.enable=false (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvbook", description="Run the kvbook engine: a 3-layer Qwen3-style decoder.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    trace = commands.add_parser("trace", help="run the 256 + 128 scenario and print the shape checklist")
    _common(trace)
    trace.add_argument("--json", action="store_true", help="print one JSON document instead of text")

    gen = commands.add_parser("generate", help="generate tokens for a prompt")
    _common(gen)
    source = gen.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="a user message, wrapped in Qwen's chat template (default: the "
                        "article's scenario, a chat prompt of exactly [inference] input_len tokens of real text)")
    source.add_argument("--input-ids", help="raw token ids, comma-separated: 9707,1879")
    gen.add_argument("--checkpoint", metavar="DIR", help="a local Hugging Face Qwen3 checkpoint directory")
    gen.add_argument("--num-layers", type=int, help="with --checkpoint: keep only the first N layers")
    gen.add_argument("--max-new-tokens", type=int, help="default: [inference] output_len")
    gen.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], help="weights, activations and cache")
    gen.add_argument("--device", help="cpu, cuda or cuda:N (default: [inference] device)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="keep the most likely tokens up to this mass (1: all)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all, default)")
    gen.add_argument("--seed", type=int, help="seed of the sampling generator")
    gen.add_argument("--ignore-eos", action="store_true", help="always produce max-new-tokens tokens")
    gen.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    gen.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                     help="split the model over N processes, one per GPU or CPU core (default: 1, no split)")

    serve = commands.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    _common(serve)
    serve.add_argument("--host", help="address to bind (default: the host of [server] api_base, 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default: the port of [server] api_base, 8000)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="info (default) logs every decode step's cache lengths; warning keeps quiet")
    serve.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM or Ctrl-C, let running requests finish this long, then end them with an "
                            "error (default: %(default)s)")

    export = commands.add_parser("export", help="write the model for another engine: a Hugging Face Qwen3 "
                                 "directory or a GGUF file for llama.cpp")
    _common(export)
    export.add_argument("--format", choices=["hf", "gguf"], required=True,
                        help="hf: a directory (config.json + model.safetensors); gguf: one file for llama.cpp")
    export.add_argument("target", metavar="PATH", help="hf: a new (or empty) directory; gguf: a new file")
    export.add_argument("--type", help="gguf: how the matrices are stored: f16 (default), q8_0 or f32")
    export.add_argument("--checkpoint", metavar="SRC", help="export this local checkpoint instead of the random "
                        "weights of the config")
    export.add_argument("--num-layers", type=int, help="with --checkpoint: keep only the first N layers")

    bench = commands.add_parser("bench", help="measure TTFT, TPOT, model-ready time, memory and the decode floor")
    _common(bench)
    bench.add_argument("--against", choices=["transformers", "llama.cpp"],
                       help="measure transformers' Qwen3ForCausalLM too; llama.cpp: and llama.cpp's F16 and Q8_0 "
                            "on the exported GGUF")
    bench.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up (default: %(default)s)")
    bench.add_argument("--steps", type=int, default=32, help="decode steps per run (default: %(default)s)")
    bench.add_argument("--rounds", type=int, default=2,
                       help="with --against: alternate engine and peer this many times (default: %(default)s)")
    bench.add_argument("--paired-rounds", type=int, default=8,
                       help="with --against: then decode in one process with the peer, alternating, this many times; "
                            "0 skips it (default: %(default)s)")
    bench.add_argument("--no-cold", action="store_true", help="skip timing a build into an empty weight cache")
    mode = bench.add_mutually_exclusive_group()  # each "instead" is a bench of its own
    mode.add_argument("--roofline", action="store_true",
                      help="instead: FLOPs, bytes, time and achieved rates of every op in prefill and one decode step")
    mode.add_argument("--batch-sweep", metavar="SIZES",
                      help="instead: TPOT, tokens/s and KV memory for each batch size, e.g. 1,2,4,8,16,32")
    mode.add_argument("--concurrency", type=int, metavar="N",
                      help="instead: one request alone, then N at once, through the server (continuous batching)")
    bench.add_argument("--max-tokens", type=int, default=64,
                       help="with --concurrency or --load: new tokens per request (default: %(default)s)")
    mode.add_argument("--load", metavar="RATES",
                      help="instead: streaming requests at each offered rate (requests/s, Poisson arrivals) "
                           "through a server process; TTFT and ITL percentiles and the knee, e.g. 0.5,1,2,4")
    bench.add_argument("--requests", type=int, default=16, help="with --load: requests per rate (default: %(default)s)")
    bench.add_argument("--url", help="with --load: a running server (http://host:port) instead of starting one")
    bench.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    return parser


def _fmt(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def cmd_trace(config: Config, args) -> None:
    from ..runtime.engine import Engine
    from ..runtime.sequence import check_token_ids
    from ..tokenizer import build_prompt_ids
    from .trace import Tracer, checklist

    input_ids = build_prompt_ids(config.inference.input_len)
    check_token_ids(input_ids, config.model.vocab_size)  # before the model loads
    engine = Engine(config, progress=not args.json)
    with Tracer(engine.model) as tracer:
        run = engine.generate(input_ids, config.inference.output_len, ignore_eos=True, tracer=tracer)
    result = checklist(tracer, run.output_ids)
    result["device"] = str(engine.device)
    result["dtype"] = config.inference.dtype
    result["kv_cache_enabled"] = config.kv_cache.enable
    result["ready_s"], result["ttft_ms"], result["tpot_ms"] = engine.ready_s, run.ttft_ms, run.tpot_ms
    if args.json:
        print(json.dumps(result))
        return
    pre = result["prefill"]
    print(f"prefill ({engine.device}, {config.inference.dtype})")
    print(f"  input_ids                 {_fmt(pre['input_ids'])}")
    print(f"  embedding                 {_fmt(pre['embedding'])}")
    for layer in pre["layers"]:
        print(f"  layer {layer['layer']} output            {_fmt(layer['output'])}")
    for c in pre["kv_cache"]:
        name = f"cache K{c['layer']} V{c['layer']}"
        print(f"  {name:26s}{_fmt(c['k'])} {_fmt(c['v'])}")
    print(f"  attention weights         {_fmt(pre['attention_weights'])}")
    print(f"  logits (last position)    {_fmt(pre['logits'])} -> first token {pre['first_token']}")
    if "blocks" in pre:
        print(f"  paged cache: {pre['blocks']} blocks of {config.kv_cache.block_size} positions")
    print(f"decode ({len(result['decode'])} steps)")
    for d in result["decode"]:
        blocks = f"  blocks {d['blocks']}" if "blocks" in d else ""
        print(f"  step {d['step']:3d}: input {_fmt(d['input'])}  Q {_fmt(d['q'])}  K/V {_fmt(d['k'])}  "
              f"attention {_fmt(d['attention_weights'])}  logits {_fmt(d['logits'])}  cache_len {d['cache_len']}"
              f"{blocks}")
    tpot = f"{run.tpot_ms:.1f}" if run.tpot_ms is not None else "-"
    print(f"model ready in {engine.ready_s:.1f} s; TTFT {run.ttft_ms:.1f} ms, TPOT {tpot} ms, "
          f"{len(run.output_ids)} tokens, final cache_len {run.cache_len}")


def cmd_serve(config: Config, args) -> None:
    import logging
    from urllib.parse import urlparse

    from ..runtime.engine import Engine
    from ..serving.server import GracefulServer, create_app

    if args.shutdown_grace < 0:
        raise ConfigError(f"--shutdown-grace {args.shutdown_grace:g}: must be >= 0 seconds")
    base = urlparse(config.server.api_base)
    host = args.host or base.hostname or "127.0.0.1"
    port = args.port if args.port is not None else (base.port or 8000)
    _check_address(host, port)  # before a minute of loading and packing, not after
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = Engine(config)
    key_state = "required" if os.environ.get(config.server.api_key_env) else "not required"
    print(f"kvbook: serving {config.model.name!r} on {engine.device} at http://{host}:{port}{base.path}"
          f"{config.server.model_endpoint} (API key {key_state}: {config.server.api_key_env}; up to "
          f"{config.server.max_num_seqs} requests decoded together; prefix caching "
          f"{'on' if config.kv_cache.prefix_caching else 'off'})", file=sys.stderr)
    GracefulServer(create_app(engine), host, port, args.shutdown_grace, args.log_level).run()


def _check_address(host: str, port: int) -> None:
    """Whether the server could listen on host:port now: one line naming the problem and the option to change."""
    import socket

    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port}: a port is 0..65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(infos[0][4])
    except OSError as err:  # socket.gaierror included: a host name nobody resolves
        raise ConfigError(f"cannot listen on {host}:{port} ({err.strerror or err}); pass another --port, or --host "
                          "an address of this machine") from None


def cmd_bench(config: Config, args) -> None:
    from .bench import format_table, run_bench

    if min(args.repeats, args.steps, args.rounds) < 1:
        raise ConfigError("--repeats, --steps and --rounds must be >= 1")
    if args.paired_rounds < 0:
        raise ConfigError("--paired-rounds must be >= 0 (0 skips the paired decode)")
    if args.url and not args.load:
        raise ConfigError("--url needs --load RATES (the load bench is the one that sends requests to a server)")
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if args.batch_sweep:
        from .bench import format_batch_sweep, run_batch_sweep

        sizes = _parse_ints(args.batch_sweep, "--batch-sweep", "batch sizes", "1,2,4,8")
        if min(sizes) < 1:
            raise ConfigError(f"--batch-sweep {args.batch_sweep!r}: batch sizes must be >= 1")
        result = run_batch_sweep(config, args.config, args.overrides, sizes, args.steps, progress=progress)
        print(json.dumps(result) if args.json else format_batch_sweep(result))
        return
    if args.load:
        from ..serving.loadgen import format_load, run_load

        try:
            rates = [float(part) for part in args.load.replace(" ", "").split(",") if part]
        except ValueError:
            rates = []
        if not rates or min(rates) <= 0 or args.requests < 1 or args.max_tokens < 1:
            raise ConfigError(f"--load {args.load!r}: expected rates > 0 in requests/s like 0.5,1,2,4 (and "
                              "--requests, --max-tokens >= 1)")
        result = run_load(config, args.config, args.overrides, sorted(rates), args.requests, args.max_tokens,
                          url=args.url, progress=progress)
        print(json.dumps(result) if args.json else format_load(result))
        return
    if args.concurrency is not None:
        from .bench import format_concurrency, run_concurrency

        if args.concurrency < 1 or args.max_tokens < 1:
            raise ConfigError("--concurrency and --max-tokens must be >= 1")
        result = run_concurrency(config, args.concurrency, args.max_tokens, progress=progress)
        print(json.dumps(result) if args.json else format_concurrency(result))
        return
    if args.roofline:
        from .bench import format_roofline, run_roofline

        result = run_roofline(args.config, args.overrides, args.repeats, progress=progress)
        print(json.dumps(result) if args.json else format_roofline(result))
        return
    result = run_bench(config, args.config, args.overrides, args.against, args.repeats, args.steps,
                       cold=not args.no_cold, rounds=args.rounds, paired_rounds=args.paired_rounds,
                       progress=progress)
    print(json.dumps(result) if args.json else format_table(result))


def _parse_ints(text: str, option: str, what: str, example: str) -> list[int]:
    """'1, 2,3' -> [1, 2, 3]; anything else is one line naming the option and an example."""
    try:
        values = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        values = []
    if not values:
        raise ConfigError(f"{option} {text!r}: expected {what} like {example}")
    return values


def cmd_generate(config: Config, args) -> None:
    from ..runtime.engine import Engine
    from ..runtime.sequence import check_sampling, check_token_ids
    from ..serving.text_stream import TextStream
    from ..tokenizer import build_prompt_ids, get_default_tokenizer

    if args.num_layers is not None and not args.checkpoint:
        raise ConfigError("--num-layers needs --checkpoint (for random weights use --set model.num_hidden_layers=N)")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    # every check that needs no model runs before the model loads
    check_sampling(args.temperature, args.top_p, args.top_k)
    tokenizer = get_default_tokenizer()
    if args.prompt is not None:
        input_ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    elif args.input_ids is not None:
        input_ids = _parse_ints(args.input_ids, "--input-ids", "comma-separated integers", "9707,1879")
    else:
        input_ids = build_prompt_ids(config.inference.input_len, tokenizer)
    if args.tensor_parallel != 1:
        _generate_on_ranks(config, args, input_ids, tokenizer)
        return
    if args.checkpoint:  # its vocabulary is its config.json's: the engine checks the ids against it
        engine = Engine.from_checkpoint(config, args.checkpoint, args.num_layers)
    else:
        check_token_ids(input_ids, config.model.vocab_size)
        engine = Engine(config, progress=not args.json)
    text_stream = TextStream(tokenizer, stop=[])  # the text as it is generated (an incomplete character waits)

    def show(step) -> None:
        print(text_stream.add(step.token_id), end="", flush=True)

    run = engine.generate(input_ids, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos,
                          on_step=None if args.json else show)
    if args.json:
        print(json.dumps({"input_ids": input_ids, "output_ids": run.output_ids,
                          "text": tokenizer.decode(run.output_ids),
                          "finish_reason": run.finish_reason, "cache_len": run.cache_len,
                          "ready_s": engine.ready_s, "ttft_ms": run.ttft_ms, "tpot_ms": run.tpot_ms,
                          "device": str(engine.device),
                          "dtype": engine.config.inference.dtype,
                          "phases": engine.describe_kernels(), "phases_text": engine.kernels.describe()}))
        return
    print(text_stream.finish())
    tpot = f"{run.tpot_ms:.1f} ms" if run.tpot_ms is not None else "-"
    print(f"[{len(input_ids)} prompt + {len(run.output_ids)} generated tokens, finish_reason "
          f"{run.finish_reason}, cache_len {run.cache_len}, TTFT {run.ttft_ms:.1f} ms, TPOT {tpot}, "
          f"{engine.device}; prefill in {str(engine.prefill_dtype).removeprefix('torch.')}, decode in "
          f"{str(engine.decode_dtype).removeprefix('torch.')}: see --json for why]", file=sys.stderr)


def _generate_on_ranks(config: Config, args, input_ids: list[int], tokenizer) -> None:
    """generate --tensor-parallel N: the same request on N ranks (kvbook.runtime.ranks); rank 0's tokens as they
    come, each rank's readiness on stderr."""
    from ..runtime import ranks
    from ..runtime.sequence import check_token_ids
    from ..serving.text_stream import TextStream

    if args.num_layers is not None:
        raise ConfigError("--num-layers does not combine with --tensor-parallel")
    if not args.checkpoint:
        check_token_ids(input_ids, config.model.vocab_size)
    text_stream = TextStream(tokenizer, stop=[])
    ready = {}

    def show(rank: int, message: tuple) -> None:
        kind, value = message
        if kind == "ready":
            ready[rank] = value
            if not args.json:
                print(f"[rank {rank} of {args.tensor_parallel}: pid {value['pid']}, ready in "
                      f"{value['ready_s']:.1f} s]", file=sys.stderr, flush=True)
        elif not args.json:
            print(text_stream.add(value), end="", flush=True)

    run = ranks.generate(config, input_ids, args.tensor_parallel, checkpoint=args.checkpoint, on_message=show,
                         progress=not args.json, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                         top_p=args.top_p, top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    if args.json:
        print(json.dumps({"input_ids": input_ids, "output_ids": run.output_ids,
                          "text": tokenizer.decode(run.output_ids), "finish_reason": run.finish_reason,
                          "cache_len": run.cache_len, "ttft_ms": run.ttft_ms, "tpot_ms": run.tpot_ms,
                          "tensor_parallel": args.tensor_parallel,
                          "ready_s": [ready[rank]["ready_s"] for rank in sorted(ready)]}))
        return
    print(text_stream.finish())
    tpot = f"{run.tpot_ms:.1f} ms" if run.tpot_ms is not None else "-"
    print(f"[{len(input_ids)} prompt + {len(run.output_ids)} generated tokens on {args.tensor_parallel} ranks, "
          f"finish_reason {run.finish_reason}, cache_len {run.cache_len}, TTFT {run.ttft_ms:.1f} ms, TPOT {tpot}]",
          file=sys.stderr)


def cmd_export(config: Config, args) -> None:
    from ..device import TORCH_DTYPES
    from ..model.weights import checkpoint_config, load_checkpoint, load_random_weights
    from .export import check_gguf, export_gguf, export_hf

    if args.num_layers is not None and not args.checkpoint:
        raise ConfigError("--num-layers needs --checkpoint (for random weights use --set model.num_hidden_layers=N)")
    if args.type and args.format != "gguf":
        raise ConfigError("--type is for --format gguf (an hf export keeps [inference] dtype)")
    dtype = TORCH_DTYPES[config.inference.dtype]
    model = checkpoint_config(args.checkpoint, args.num_layers) if args.checkpoint else config.model
    gguf_type = args.type or "f16"
    if args.format == "gguf":
        check_gguf(model, gguf_type)  # before reading gigabytes of weights
    weights = load_checkpoint(args.checkpoint, model, dtype) if args.checkpoint else load_random_weights(model, dtype)
    layers = f"{model.num_hidden_layers} layer{'s' if model.num_hidden_layers > 1 else ''}"
    if args.format == "gguf":
        path = export_gguf(model, weights, args.target, gguf_type, progress=True)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB, {gguf_type}, {layers}, Qwen's "
              "vocabulary and chat template)")
        print(f"run it: llama-cli -m {path}   (or: python -m llama_cpp.server --model {path})")
        return
    directory = export_hf(model, weights, args.target)
    size = (directory / "model.safetensors").stat().st_size
    print(f"wrote {directory}: config.json, generation_config.json, model.safetensors ({size / 1e9:.2f} GB, "
          f"{config.inference.dtype}, {layers})")
    print(f"run it: vllm serve {directory} --tokenizer Qwen/Qwen3-0.6B   (no tokenizer files are written: "
          "kvbook's vocabulary is Qwen3's, any Qwen3 tokenizer reads it)")


def _flag_overrides(args) -> list[str]:
    """--dtype and --device are shorthands for --set overrides (the cache follows the model's dtype)."""
    extra = []
    if getattr(args, "dtype", None):
        extra += [f"inference.dtype={args.dtype}", f"kv_cache.cache_dtype={args.dtype}"]
    if getattr(args, "device", None):
        extra.append(f"inference.device={args.device}")
    return extra


COMMANDS = {"trace": cmd_trace, "generate": cmd_generate, "serve": cmd_serve, "bench": cmd_bench,
            "export": cmd_export}


def main(argv: list[str] | None = None) -> int:
    enable_huge_pages()  # before any tensor is allocated (kvbook.kernels.memory)
    warnings.formatwarning = lambda message, category, *rest: f"kvbook: warning: {message}\n"
    try:
        args = build_parser().parse_args(argv)
        config = load_config(args.config, args.overrides + _flag_overrides(args))
        COMMANDS[args.command](config, args)
    except (ConfigError, CheckpointError, CacheFullError, ValueError, OSError) as err:
        if os.environ.get("KVBOOK_DEBUG"):
            raise
        print(f"kvbook: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvbook: interrupted", file=sys.stderr)
        return 130
    return 0
