"""``statetier lookup``: how many tokens of a prompt the daemon could restore, layer by layer.

``--tokens FILE`` holds the prompt's token ids (a JSON list, or integers separated by spaces
or commas). ``--model FILE`` says which layers the model has and, optionally, its namespace:

- a lookup spec (JSON): ``attention_layers``, ``ssm_layers``, and optionally ``namespace``
  (the 64-hex digest ``statetier ls`` shows, or the fields of a ``NamespaceSpec``),
  ``block_size``, ``kv_layout`` (``"prefix"``: one KV page ``[0, N)`` per boundary, as the
  transformers adapter stores; ``"blocks"``: one page per block, as the vLLM connector does),
  ``hash_seed``, ``tp_size``;
- or a Hugging Face ``config.json`` (it has ``model_type``): its layers are read with
  transformers (imported only then), and ``--namespace`` gives the digest.

Boundaries are every block end and the prompt's end. One LOOKUP per layer (never leased)
says how far that layer alone reaches; one over every layer gives the joint hit, the
largest boundary at which all of them hold (DESIGN §4).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from statetier.clients.values import lookup_meta
from statetier.protocol.errors import InvalidRequest
from statetier.protocol.frames import Op
from statetier.protocol.identity import NamespaceSpec, prefix_hash, prefix_hashes
from statetier.protocol.wire_meta import LookupMeta, LookupReply, decode_reply

from .admin import over_connection
from .formatting import table


def run_lookup(args: argparse.Namespace) -> int:
    tokens = read_tokens(Path(args.tokens))
    plan = read_plan(Path(args.model), args)
    boundaries = [((i + 1) * plan["block_size"], h)
                  for i, h in enumerate(prefix_hashes(tokens, plan["block_size"], seed=plan["hash_seed"]))]
    if not boundaries or boundaries[-1][0] != len(tokens):
        boundaries.append((len(tokens), prefix_hash(tokens, block_size=plan["block_size"], seed=plan["hash_seed"])))

    async def ask_all(conn) -> dict:
        def meta(attention: list[int], ssm: list[int]) -> LookupMeta:
            return lookup_meta(bytes.fromhex(plan["namespace"]), attention, ssm, boundaries,
                               kv_layout=plan["kv_layout"], lease=False, tp_size=plan["tp_size"])

        async def tokens_of(m: LookupMeta) -> int:
            return decode_reply(LookupReply, (await conn.request(Op.LOOKUP, m)).meta).tokens

        layers = [("attention", layer, meta([layer], [])) for layer in plan["attention_layers"]]
        layers += [("ssm", layer, meta([], [layer])) for layer in plan["ssm_layers"]]
        found = [(kind, layer, await tokens_of(m)) for kind, layer, m in layers]
        joint = await tokens_of(meta(plan["attention_layers"], plan["ssm_layers"]))
        return {"namespace": plan["namespace"], "tokens": len(tokens), "block_size": plan["block_size"],
                "kv_layout": plan["kv_layout"], "tp_size": plan["tp_size"], "joint_hit": joint,
                "layers": [{"layer": layer, "kind": kind, "tokens": n} for kind, layer, n in found]}

    result = over_connection(args, ask_all)
    print(json.dumps(result, indent=2) if args.json else format_lookup(result))
    return 0


def format_lookup(result: dict) -> str:
    lines = [f"namespace {result['namespace']}: {result['tokens']} tokens, blocks of {result['block_size']}, "
             f"kv_layout {result['kv_layout']}, {result['tp_size']} TP shard(s)"]
    rows = [("layer", "kind", "restorable tokens")]
    rows += [(str(item["layer"]), item["kind"], str(item["tokens"])) for item in sorted(result["layers"],
                                                                                        key=lambda i: i["layer"])]
    lines += table(rows)
    joint, layers = result["joint_hit"], result["layers"]
    lines.append(f"joint hit: {joint} of {result['tokens']} tokens")
    short = [item for item in layers if item["tokens"] == min((i["tokens"] for i in layers), default=0)]
    if layers and joint < max(item["tokens"] for item in layers):
        names = ", ".join(f"{item['kind']} {item['layer']}" for item in short[:8])
        lines.append(f"  limited by: {names}{' …' if len(short) > 8 else ''} (the joint hit is the largest boundary "
                     f"at which every layer holds its state)")
    return "\n".join(lines)


def read_tokens(path: Path) -> list[int]:
    text = _read(path, "--tokens").strip()
    try:
        tokens = json.loads(text) if text.startswith("[") else [int(t) for t in re.split(r"[\s,]+", text) if t]
    except ValueError as exc:
        raise InvalidRequest(f"--tokens {path}: not a JSON list or integers separated by spaces or commas "
                             f"({exc})") from None
    if not tokens or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        raise InvalidRequest(f"--tokens {path}: expected a non-empty list of non-negative integers")
    return tokens


def read_plan(path: Path, args: argparse.Namespace) -> dict:
    try:
        spec = json.loads(_read(path, "--model"))
    except ValueError as exc:
        raise InvalidRequest(f"--model {path}: not JSON ({exc})") from None
    if not isinstance(spec, dict):
        raise InvalidRequest(f"--model {path}: expected a JSON object")
    if "model_type" in spec:
        spec = {**_layers_of_hf_config(spec), **{k: spec[k] for k in ("namespace",) if k in spec}}
    namespace, block_size = spec.get("namespace"), spec.get("block_size")
    if isinstance(namespace, dict):
        ns_spec = NamespaceSpec(**namespace)
        namespace, block_size = ns_spec.namespace().hex(), block_size or ns_spec.kv_block_size
    namespace = args.namespace or namespace
    if not isinstance(namespace, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", namespace):
        raise InvalidRequest("the namespace is needed: --namespace HEX (as `statetier ls` shows it), or \"namespace\" "
                             "in the lookup spec")
    plan = {"namespace": namespace.lower(), "block_size": int(args.block_size or block_size or 16),
            "kv_layout": args.kv_layout or spec.get("kv_layout", "prefix"), "hash_seed": int(spec.get("hash_seed", 0)),
            "tp_size": int(spec.get("tp_size", 1))}
    for name in ("attention_layers", "ssm_layers"):
        layers = spec.get(name, [])
        if not isinstance(layers, list) or not all(isinstance(x, int) and x >= 0 for x in layers):
            raise InvalidRequest(f"--model {path}: {name!r} must be a list of layer indices")
        plan[name] = layers
    if not plan["attention_layers"] and not plan["ssm_layers"]:
        raise InvalidRequest(f"--model {path}: no attention_layers and no ssm_layers")
    return plan


def _layers_of_hf_config(config: dict) -> dict:
    from transformers import AutoConfig  # only for a config.json: it imports torch

    from statetier.clients.transformers.cache import cache_plan

    fields = {k: v for k, v in config.items() if k != "model_type"}
    plan = cache_plan(AutoConfig.for_model(config["model_type"], **fields))
    return {"attention_layers": list(plan.attention_layers), "ssm_layers": list(plan.ssm_layers)}


def _read(path: Path, flag: str) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise InvalidRequest(f"{flag} {path}: {exc.strerror or exc}") from None
