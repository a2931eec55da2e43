"""Transformed loads end to end: tensors saved to a real moto S3 server, loaded through
``sc.load(..., transforms=...)`` into fused / transposed / cast / sliced targets."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import yaml
from safetensors.torch import save as st_save

import streamckpt as sc
import streamckpt.transforms
from streamckpt import TransformError
from streamckpt.transforms import Transforms

from test_transforms import SPLIT_TRANSPOSE_CAST

CONFIGS = Path(streamckpt.transforms.__file__).resolve().parent / "presets"  # configs/transforms links here
MiB = 1 << 20


def numbered(shape: tuple[int, ...], start: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(math.prod(shape), dtype=torch.float64) + start).reshape(shape).to(dtype)


def qkv_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: int, g: int) -> torch.Tensor:
    hd = q.shape[0] // h
    qs, ks, vs = q.split((h // g) * hd), k.split(hd), v.split(hd)
    return torch.cat([t for grp in range(g) for t in (qs[grp], ks[grp], vs[grp])])


def test_split_transpose_cast_round_trip(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """[[0,1],[2,3]] fp16 split on dim 1, transposed to 1x2, cast to fp32: [[0,2]] and [[1,3]]."""
    sc.save({"w": torch.tensor([[0, 1], [2, 3]], dtype=torch.float16)}, s3_uri, storage_options=s3_opts)
    sd = {"a": torch.zeros(1, 2), "b": torch.zeros(1, 2)}
    res = sc.load(sd, s3_uri, storage_options=s3_opts, transforms=SPLIT_TRANSPOSE_CAST)
    assert sd["a"].tolist() == [[0.0, 2.0]] and sd["b"].tolist() == [[1.0, 3.0]]
    assert res.missing_keys == [] and res.bytes_read == 8  # the 4 fp16 stored elements


def test_fuse_three_tensors_and_a_tp_slice_reads_only_its_rows(s3_uri: str, s3_opts: dict[str, Any],
                                                                 tmp_path: Path) -> None:
    cols = 4096  # fp32 rows of 16 KiB: skipped regions are > 1 MiB, so they are not read
    parts = {"p0": numbered((96, cols)), "p1": numbered((64, cols), 1e6), "p2": numbered((160, cols), 2e6)}
    sc.save(parts, s3_uri, storage_options=s3_opts)
    fused = torch.cat(list(parts.values()))
    rules = [{"fuse": {"from": ["p0", "p1", "p2"], "to": "fused", "dim": 0}}]
    config = tmp_path / "fuse.yaml"   # a local YAML file next to an S3 checkpoint
    config.write_text(yaml.safe_dump({"rules": rules}))
    whole = {"fused": torch.zeros(320, cols)}
    sc.load(whole, s3_uri, storage_options=s3_opts, transforms=str(config))
    assert torch.equal(whole["fused"], fused)
    # TP=4 over rows: rank 1 holds rows [80, 160): 16 rows of p0 and all 64 of p1
    local = torch.zeros(80, cols)
    res = sc.load({"fused": sc.ShardedTensor(local, (320, cols), (80, 0))}, s3_uri,
                  storage_options=s3_opts, transforms=sc.Transforms.from_rules(rules))
    assert torch.equal(local, fused[80:160])
    assert res.bytes_needed == 80 * cols * 4
    assert res.bytes_needed <= res.bytes_read <= res.bytes_needed + 1 * MiB
    assert res.bytes_read < 2 * res.bytes_needed


def test_fuse_qkv_tp_slices_read_only_their_rows_of_q_k_v(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    h, g, hd, hidden = 8, 2, 64, 2048     # q 4 MiB, k and v 1 MiB each (fp32)
    q = numbered((h * hd, hidden))
    k = numbered((g * hd, hidden), 1e7)
    v = numbered((g * hd, hidden), 2e7)
    sc.save({"attn.q_proj.weight": q, "attn.k_proj.weight": k, "attn.v_proj.weight": v}, s3_uri,
            storage_options=s3_opts)
    rules = [{"fuse_qkv": {"from": ["attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"],
                           "to": "attn.wqkv.weight", "num_heads": h, "num_kv_heads": g}}]
    ref = qkv_reference(q, k, v, h, g)
    rows = ref.shape[0] // 2
    stored = (q.numel() + k.numel() + v.numel()) * 4
    for rank in range(2):   # TP=2: each rank holds one KV group = 4 q heads + 1 k + 1 v
        local = torch.zeros(rows, hidden)
        res = sc.load({"attn.wqkv.weight": sc.ShardedTensor(local, ref.shape, (rank * rows, 0))}, s3_uri,
                      storage_options=s3_opts, transforms=rules)
        assert torch.equal(local, ref[rank * rows:(rank + 1) * rows])
        assert res.bytes_needed == rows * hidden * 4 == stored // 2
        # only this group's rows of q, k and v (plus gaps under 1 MiB that coalescing reads through)
        assert res.bytes_needed <= res.bytes_read <= res.bytes_needed + 1 * MiB, res
        # never the other group's 2 MiB of q rows: at most 4 of the 6 stored MiB
        assert res.bytes_read <= stored * 2 // 3


def test_fuse_qkv_into_a_zero_flat_shard(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    h, g, hd, hidden = 8, 2, 3, 5
    q, k, v = numbered((h * hd, hidden)), numbered((g * hd, hidden), 500), numbered((g * hd, hidden), 900)
    sc.save({"q": q, "k": k, "v": v}, s3_uri, storage_options=s3_opts)
    rules = [{"fuse_qkv": {"from": ["q", "k", "v"], "to": "w", "num_heads": h, "num_kv_heads": g}}]
    ref = qkv_reference(q, k, v, h, g)
    start, stop = 7, ref.numel() - 11
    local = torch.zeros(stop - start)
    sc.load({"w": sc.ShardedTensor(local, ref.shape, (0, 0), local_shape=ref.shape, flat_range=(start, stop))}, s3_uri,
            storage_options=s3_opts, transforms=rules)
    assert torch.equal(local, ref.reshape(-1)[start:stop])


def _hf_llama(layers: int = 2, h: int = 32, g: int = 8, hd: int = 2, hidden: int = 6, ffn: int = 5,
              vocab: int = 7) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    shapes = {"self_attn.q_proj.weight": (h * hd, hidden), "self_attn.k_proj.weight": (g * hd, hidden),
              "self_attn.v_proj.weight": (g * hd, hidden), "self_attn.o_proj.weight": (hidden, h * hd),
              "mlp.gate_proj.weight": (ffn, hidden), "mlp.up_proj.weight": (ffn, hidden),
              "mlp.down_proj.weight": (hidden, ffn), "input_layernorm.weight": (hidden,),
              "post_attention_layernorm.weight": (hidden,), "self_attn.rotary_emb.inv_freq": (hd // 2,)}
    out["model.embed_tokens.weight"] = numbered((vocab, hidden), 1, torch.bfloat16)
    for i in range(layers):
        for j, (n, s) in enumerate(shapes.items()):
            out[f"model.layers.{i}.{n}"] = numbered(s, 3 * i + j, torch.bfloat16)
    out["model.norm.weight"] = numbered((hidden,), 2, torch.bfloat16)
    out["lm_head.weight"] = numbered((vocab, hidden), 3, torch.bfloat16)
    return out


def test_hf_safetensors_llama_into_fused_model_with_a_yaml_on_s3(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """A real HF ``model.safetensors`` + the shipped config (itself read from the bucket)."""
    hf = _hf_llama()
    fs = fsspec.filesystem("s3", **s3_opts)
    with fs.open(f"{s3_uri}/model/model.safetensors", "wb") as fh:
        fh.write(st_save(hf))
    yaml_uri = f"{s3_uri}/config/llama.yaml"
    fs.pipe(yaml_uri, (CONFIGS / "hf_llama_to_megatron_gqa.yaml").read_bytes())
    fs.invalidate_cache()
    rules = Transforms.from_yaml(yaml_uri, s3_opts).rules + [
        {"cast": {"key": "layers.{i}.*.*.weight", "dtype": "float32"}}]   # fp32 master weights for the blocks
    model: dict[str, torch.Tensor] = {
        "tok_embeddings.weight": torch.zeros(7, 6, dtype=torch.bfloat16),
        "norm.weight": torch.zeros(6, dtype=torch.bfloat16),
        "output.weight": torch.zeros(7, 6, dtype=torch.bfloat16),
    }
    for i in range(2):
        model |= {f"layers.{i}.attention.wqkv.weight": torch.zeros(96, 6),
                  f"layers.{i}.attention.wo.weight": torch.zeros(6, 64),
                  f"layers.{i}.feed_forward.w13.weight": torch.zeros(10, 6),
                  f"layers.{i}.feed_forward.w2.weight": torch.zeros(6, 5),
                  f"layers.{i}.attention_norm.weight": torch.zeros(6, dtype=torch.bfloat16),
                  f"layers.{i}.ffn_norm.weight": torch.zeros(6, dtype=torch.bfloat16)}
    res = sc.load(model, f"{s3_uri}/model", storage_options=s3_opts, transforms=rules)
    assert res.missing_keys == [] and res.unexpected_keys == []
    for i in range(2):
        p = f"model.layers.{i}."
        want = qkv_reference(hf[p + "self_attn.q_proj.weight"], hf[p + "self_attn.k_proj.weight"],
                             hf[p + "self_attn.v_proj.weight"], 32, 8).float()
        assert torch.equal(model[f"layers.{i}.attention.wqkv.weight"], want)
        assert torch.equal(model[f"layers.{i}.feed_forward.w13.weight"],
                           torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]).float())
        assert torch.equal(model[f"layers.{i}.attention.wo.weight"], hf[p + "self_attn.o_proj.weight"].float())
        assert torch.equal(model[f"layers.{i}.ffn_norm.weight"], hf[p + "post_attention_layernorm.weight"])
    assert torch.equal(model["output.weight"], hf["lm_head.weight"])
    needed_src = sum(t.numel() * 2 for n, t in hf.items() if "inv_freq" not in n)
    # the dropped inv_freq buffers (2 bytes each) may be read through as coalescing gaps
    assert needed_src <= res.bytes_read <= needed_src + 2 * 2


def test_a_preset_by_name_in_load_full(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    """``transforms="hf_llama_to_vllm"``: the rules shipped inside the package, by name."""
    hf = _hf_llama(layers=1, h=4, g=2)
    sc.save(hf, s3_uri, storage_options=s3_opts)
    out = sc.load_full(s3_uri, storage_options=s3_opts, transforms="hf_llama_to_vllm")
    p = "model.layers.0."
    assert torch.equal(out[p + "self_attn.qkv_proj.weight"], torch.cat(
        [hf[p + "self_attn.q_proj.weight"], hf[p + "self_attn.k_proj.weight"], hf[p + "self_attn.v_proj.weight"]]))
    assert torch.equal(out[p + "mlp.gate_up_proj.weight"],
                       torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]))
    assert p + "self_attn.rotary_emb.inv_freq" not in out and torch.equal(out["lm_head.weight"], hf["lm_head.weight"])


def test_transposed_projection_and_cast_configs_with_load_full(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    hidden = 8
    gpt2 = {"h.0.attn.c_attn.weight": numbered((hidden, 3 * hidden), 0, torch.bfloat16),
            "h.0.attn.c_attn.bias": numbered((3 * hidden,), 300, torch.bfloat16),
            "h.0.attn.c_proj.weight": numbered((hidden, hidden), 400, torch.bfloat16),
            "h.0.attn.c_proj.bias": numbered((hidden,), 500, torch.bfloat16),
            "h.0.mlp.c_fc.weight": numbered((hidden, 4 * hidden), 600, torch.bfloat16),
            "h.0.mlp.c_fc.bias": numbered((4 * hidden,), 700, torch.bfloat16),
            "h.0.mlp.c_proj.weight": numbered((4 * hidden, hidden), 800, torch.bfloat16),
            "h.0.mlp.c_proj.bias": numbered((hidden,), 900, torch.bfloat16),
            "h.0.attn.bias": torch.ones(1, 1, 4, 4, dtype=torch.bfloat16)}
    sc.save(gpt2, s3_uri, storage_options=s3_opts)
    rules = Transforms.from_yaml(str(CONFIGS / "gpt2_conv1d_to_linear.yaml")).rules + [
        {"cast": {"key": "h.{i}.*.*.weight", "dtype": "float32"}}]
    out = sc.load_full(s3_uri, storage_options=s3_opts, transforms=rules)
    c_attn = gpt2["h.0.attn.c_attn.weight"].float()
    assert torch.equal(out["h.0.attn.q.weight"], c_attn[:, :hidden].T)
    assert torch.equal(out["h.0.attn.v.weight"], c_attn[:, 2 * hidden:].T)
    assert torch.equal(out["h.0.attn.k.bias"], gpt2["h.0.attn.c_attn.bias"][hidden:2 * hidden])
    assert torch.equal(out["h.0.mlp.fc_out.weight"], gpt2["h.0.mlp.c_proj.weight"].float().T)
    assert out["h.0.mlp.fc_out.weight"].dtype == torch.float32 and "h.0.attn.bias" not in out
    # a column-parallel slice of a transposed projection: rows [8, 16) of fc_in = cols of c_fc
    local = torch.zeros(8, hidden)
    sc.load({"h.0.mlp.fc_in.weight": sc.ShardedTensor(local, (4 * hidden, hidden), (8, 0))}, s3_uri,
            storage_options=s3_opts, transforms=rules, strict=False)
    assert torch.equal(local, gpt2["h.0.mlp.c_fc.weight"].float().T[8:16])


def test_layer_patterns_and_optimizer_states_follow_a_rename(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    layers = 4
    model = {f"model.layers.{i}.mlp.down_proj.weight": numbered((3, 4), 100 * i) for i in range(layers)}
    optim = {name: {"exp_avg": t + 0.5, "exp_avg_sq": t * 2} for name, t in model.items()}
    sc.save({**model, "optim": {"state": optim}}, s3_uri, storage_options=s3_opts)
    rules = [{"rename": {"from": "model.layers.{i}.mlp.down_proj.weight", "to": "layers.{i}.ffn.w2.weight"}}]
    target: dict[str, Any] = {f"layers.{i}.ffn.w2.weight": torch.zeros(3, 4) for i in range(layers)}
    target["optim"] = {"state": {f"layers.{i}.ffn.w2.weight": {"exp_avg": torch.zeros(3, 4),
                                                               "exp_avg_sq": torch.zeros(3, 4)}
                                 for i in range(layers)}}
    res = sc.load(target, s3_uri, storage_options=s3_opts, transforms=rules)
    assert res.missing_keys == [] and res.unexpected_keys == []
    for i in range(layers):
        src = model[f"model.layers.{i}.mlp.down_proj.weight"]
        assert torch.equal(target[f"layers.{i}.ffn.w2.weight"], src)
        st = target["optim"]["state"][f"layers.{i}.ffn.w2.weight"]
        assert torch.equal(st["exp_avg"], src + 0.5) and torch.equal(st["exp_avg_sq"], src * 2)


def test_transform_errors_through_load(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    sc.save({"a": numbered((4, 2)), "b": numbered((4, 3)), "h": numbered((4, 2), 0, torch.float16)}, s3_uri,
            storage_options=s3_opts)

    def load(sd: dict[str, torch.Tensor], rules: list[dict[str, Any]]) -> None:
        sc.load(sd, s3_uri, storage_options=s3_opts, transforms=rules)

    with pytest.raises(TransformError, match=r"rule #0 .*source name 'zz' .*not in the view"):
        load({"c": torch.zeros(8, 2)}, [{"fuse": {"from": ["a", "zz"], "to": "c"}}])
    with pytest.raises(TransformError, match=r"rule #0 .*shapes disagree off the fuse dim 0"):
        load({"c": torch.zeros(8, 2)}, [{"fuse": {"from": ["a", "b"], "to": "c"}}])
    with pytest.raises(TransformError, match=r"rule #0 .*does not divide into 3 equal parts"):
        load({"x": torch.zeros(1, 2)}, [{"split": {"from": "a", "to": ["x", "y", "z"]}}])
    with pytest.raises(TransformError, match=r"rule #1 .*dtypes disagree"):
        load({"c": torch.zeros(4, 4)}, [{"rename": {"from": "a", "to": "t"}},
                                        {"fuse": {"from": ["t", "h"], "to": "c", "dim": 1}}])
    # the final shape / dtype against the state_dict (checked by the planner)
    with pytest.raises(TransformError, match=r"c.*shape \[8, 2\].*\[4, 4\]"):
        load({"c": torch.zeros(4, 4)}, [{"rename": {"from": "a", "to": "c"}},
                                        {"fuse": {"from": ["c", "c"], "to": "c2"}},
                                        {"rename": {"from": "c2", "to": "c"}}])
    with pytest.raises(TransformError, match=r"h.*dtype F16.*add a 'cast'"):
        load({"h": torch.zeros(4, 2)}, [{"rename": {"from": "a", "to": "a2"}}])


def _tp_worker(rank: int, world: int, uri: str, opts: dict[str, Any]) -> dict[str, Any]:
    """One TP rank: its rows of a fused wqkv and of w13, built from HF-named q/k/v and gate/up."""
    from distributed import check_equal, result_dict

    h, g, hd, hidden, ffn = 8, 2, 16, 512, 768
    q, k, v = numbered((h * hd, hidden)), numbered((g * hd, hidden), 1e6), numbered((g * hd, hidden), 2e6)
    gate, up = numbered((ffn, hidden), 3e6), numbered((ffn, hidden), 4e6)
    wqkv = qkv_reference(q, k, v, h, g)
    w13 = torch.cat([gate, up])
    rules = [
        {"fuse_qkv": {"from": ["l.{i}.q", "l.{i}.k", "l.{i}.v"], "to": "layers.{i}.wqkv",
                      "num_heads": h, "num_kv_heads": g}},
        {"fuse": {"from": ["l.{i}.gate", "l.{i}.up"], "to": "layers.{i}.w13", "dim": 0}},
    ]
    rq, rm = wqkv.shape[0] // world, w13.shape[0] // world
    sd = {"layers.0.wqkv": sc.ShardedTensor(torch.zeros(rq, hidden), wqkv.shape, (rank * rq, 0)),
          "layers.0.w13": sc.ShardedTensor(torch.zeros(rm, hidden), w13.shape, (rank * rm, 0))}
    res = sc.load(sd, uri, storage_options=opts, transforms=rules)
    check_equal("wqkv", sd["layers.0.wqkv"].local_tensor, wqkv[rank * rq:(rank + 1) * rq])
    check_equal("w13", sd["layers.0.w13"].local_tensor, w13[rank * rm:(rank + 1) * rm])
    return result_dict(res)


def test_two_ranks_load_their_tp_slices_of_fused_tensors(s3_uri: str, s3_opts: dict[str, Any]) -> None:
    from distributed import run_ranks

    h, g, hd, hidden, ffn = 8, 2, 16, 512, 768
    sc.save({"l.0.q": numbered((h * hd, hidden)), "l.0.k": numbered((g * hd, hidden), 1e6),
             "l.0.v": numbered((g * hd, hidden), 2e6), "l.0.gate": numbered((ffn, hidden), 3e6),
             "l.0.up": numbered((ffn, hidden), 4e6)}, s3_uri, storage_options=s3_opts)
    results = [r.unwrap() for r in run_ranks(2, _tp_worker, kwargs={"uri": s3_uri, "opts": s3_opts})]
    stored = ((h + 2 * g) * hd + 2 * ffn) * hidden * 4
    for res in results:
        assert res["bytes_needed"] == stored // 2
        # what a rank did not read itself came from its peer
        assert res["bytes_read"] + res["bytes_received"] >= res["bytes_needed"]
    # read_once: together the ranks read every stored byte at most once (no overlap, no re-reads)
    assert sum(r["bytes_read"] for r in results) == stored
