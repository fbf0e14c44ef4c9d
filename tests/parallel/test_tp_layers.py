"""Tensor parallelism on CPU: two spawned processes form a gloo group bound to 127.0.0.1,
each builds the whole model cut in two with `TensorParallel` (Megatron-core's layers), and
runs a hybrid micro-batch (a later prefill chunk plus two decodes) through it.

Every rank's logits equal the unsharded model's (and `transformers`'), for GPT-2 with a tied
head and an odd vocabulary (padded), GPT-2 untied, LLaMA with GQA (8 query heads over 2
KV heads) and an odd vocabulary, from safetensors and from `pytorch_model.bin`, and Qwen2
(q/k/v biases cut with their rows, tied, odd vocabulary); a last stage alone (its tied head
read from `wte`) too. Random init gives each rank exactly its slice of
the unsharded weights. Each rank reads from the safetensors files exactly the elements it
holds. The processes are spawned once for the whole module and always reaped.
"""
from __future__ import annotations

import multiprocessing
import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from pp_runtime.core.batch import MicroBatch, Sampling, SeqChunk, slot_blocks
from pp_runtime.model.attention import BatchLayout
from pp_runtime.model.kv_cache import KVCache
from pp_runtime.model.loader import load_stage_weights, model_config_from_hf, read_hf_config
from pp_runtime.model.transformer import StageModel
from pp_runtime.profile.p2p import _reap
from pp_runtime.core.net import free_port
from pp_runtime.parallel.layers import Shard, Unsharded, shard_of

TP = 2
START_S = 90.0  # both ranks must report within this
SEED = 7
GREEDY = Sampling(0.0, 1.0, 0)


@dataclass(frozen=True)
class Job:
    """One model every rank builds, runs and reports on (picklable for spawn)."""

    name: str
    path: str  # HF checkpoint directory (its config.json gives the shapes)
    lo: int = 0  # first layer; > 0: a last stage alone, fed hidden states
    random: bool = False  # init_random(SEED) instead of loading the checkpoint


# ---- the work, identical in the children and the parent ----------------------------------
def prompts() -> dict[int, list[int]]:
    g = torch.Generator().manual_seed(3)
    return {rid: torch.randint(1, 300, (n,), generator=g).tolist()
            for rid, n in ((0, 25), (1, 8), (2, 5))}


def micro_batches() -> list[MicroBatch]:
    """Request 0 is prefilled in chunks [0, 10) and [10, 25); requests 1 and 2 are prefilled
    beside its first chunk and decode beside its second: the second batch is hybrid."""
    p = prompts()
    first = (SeqChunk(0, 0, 0, tuple(p[0][:10]), None), SeqChunk(1, 1, 0, tuple(p[1][:7]), None),
             SeqChunk(2, 2, 0, tuple(p[2][:4]), None))
    hybrid = (SeqChunk(1, 1, 7, (p[1][7],), GREEDY, is_decode=True),
              SeqChunk(2, 2, 4, (p[2][4],), GREEDY, is_decode=True),
              SeqChunk(0, 0, 10, tuple(p[0][10:25]), None))
    return [MicroBatch(0, first), MicroBatch(1, hybrid)]


def build(job: Job, par) -> StageModel:
    m = model_config_from_hf(read_hf_config(job.path))
    model = StageModel(m, job.lo, m.num_layers, par)
    if job.random:
        model.init_random(SEED)
    else:
        load_stage_weights(model, job.path)
    return model.eval().requires_grad_(False)


@torch.inference_mode()
def hybrid_logits(model: StageModel, tp: int) -> torch.Tensor:
    """Logits [2 + 15, vocab] of every row of the hybrid micro-batch."""
    m, cpu = model.cfg, torch.device("cpu")
    cache = KVCache(model.hi - model.lo, 3 * 2, 16, m.kv_heads // tp, m.head_dim, torch.float32,
                    cpu)  # 3 contexts of 2 blocks of 16 positions
    g = torch.Generator().manual_seed(5)  # hidden states from a (pretend) previous stage
    for mb in micro_batches():
        seqs = tuple(replace(s, blocks=slot_blocks(s.blocks, 2)) for s in mb.seqs)
        layout = BatchLayout.build(MicroBatch(mb.mb_id, seqs), cpu, 16)
        x = (torch.tensor([t for s in mb.seqs for t in s.token_ids]) if model.is_first
             else torch.randn(mb.num_tokens, m.hidden_size, generator=g))  # [T] or [T, hidden]
        logits = model.logits(model(x, cache, layout))  # [T, vocab]
    return logits


# ---- the two children ---------------------------------------------------------------------
def _join_group(rank: int, port: int) -> None:
    """A 2-rank gloo group with every socket on 127.0.0.1."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    listen_fd = None
    if rank == 0:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        listen_fd = server.detach()  # the store owns it from here
    store = torch.distributed.TCPStore("127.0.0.1", port, TP, rank == 0, timedelta(seconds=60),
                                       master_listen_fd=listen_fd)
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=TP,
                                         timeout=timedelta(seconds=60))


class _CountingFile:
    """Stands in for `safetensors.safe_open` in the children: counts every element read."""

    real = None  # the real safe_open
    elements = 0

    def __init__(self, *args, **kwargs):
        self.h = _CountingFile.real(*args, **kwargs)

    def keys(self):
        return self.h.keys()

    def get_slice(self, key):
        return _CountingSlice(self.h.get_slice(key))

    def get_tensor(self, key):
        t = self.h.get_tensor(key)
        _CountingFile.elements += t.numel()
        return t


class _CountingSlice:
    def __init__(self, s):
        self.s = s

    def get_shape(self):
        return self.s.get_shape()

    def __getitem__(self, index):
        t = self.s[index]
        _CountingFile.elements += t.numel()
        return t


def _padding(p: torch.Tensor) -> int:
    """Elements of `p` that are vocabulary padding (zeros not read from the file)."""
    shard = shard_of(p)
    if shard.dim is None:
        return 0
    return sum(z for _, _, z in shard.ranges()) * p.numel() // p.shape[shard.dim]


def _run_job(job: Job, rank: int) -> dict:
    from pp_runtime.parallel.layers import TensorParallel

    par = TensorParallel(torch.distributed.group.WORLD, TP, rank, torch.float32)
    before = _CountingFile.elements
    model = build(job, par)
    read = _CountingFile.elements - before
    whole = dict(build(job, Unsharded()).named_parameters())
    params = dict(model.named_parameters())
    return {"logits": hybrid_logits(model, TP).numpy(), "read": read,
            "held": sum(p.numel() - _padding(p) for p in params.values()),
            "not_a_slice": [n for n, p in params.items()
                            if not torch.equal(shard_of(p).take(whole[n]), p)],
            "shapes": {n: tuple(p.shape) for n, p in params.items()}}


def _child(rank: int, port: int, jobs: list[Job], results) -> None:
    torch.set_num_threads(1)
    try:
        _join_group(rank, port)
        import safetensors

        _CountingFile.real, safetensors.safe_open = safetensors.safe_open, _CountingFile
        for job in jobs:
            results.put(("ok", rank, job.name, _run_job(job, rank)))
        results.put(("done", rank, None, None))
    except BaseException:
        results.put(("error", rank, None, traceback.format_exc()))
        raise SystemExit(1)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


# ---- the parent ---------------------------------------------------------------------------
def run_ranks(jobs: list[Job]) -> dict[tuple[int, str], dict]:
    """(rank, job name) -> what that rank reported; raises if a rank fails or goes quiet."""
    ctx = torch.multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), free_port("127.0.0.1")
    procs = [ctx.Process(target=_child, args=(rank, port, jobs, results), daemon=True)
             for rank in range(TP)]
    out, done = {}, set()
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + START_S
        while len(done) < TP:
            try:
                kind, rank, name, payload = results.get(timeout=1.0)
            except queue.Empty:
                codes = [p.exitcode for p in procs]
                if time.monotonic() > deadline or any(c not in (None, 0) for c in codes):
                    raise RuntimeError(f"the ranks went quiet; exit codes {codes}")
                continue
            if kind == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            if kind == "done":
                done.add(rank)
            else:
                out[(rank, name)] = payload
    finally:  # after an error the survivor may wait on its peer forever: no grace then
        _reap(procs, 10.0 if len(done) == TP else 0.0)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[object, Path]]:
    """name -> (transformers model, directory)."""
    from conftest import hf_model

    models = {"gpt-tied-301": hf_model("gpt", vocab_size=301),
              "gpt-untied": hf_model("gpt", tie_word_embeddings=False),
              "llama-gqa-301": hf_model("llama", vocab_size=301),
              "qwen2-bias-301": hf_model("qwen2", vocab_size=301)}
    out = {}
    for name, model in models.items():
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path, max_shard_size="100KB")
        out[name] = (model, path)
    llama, path = models["llama-gqa-301"], tmp_path_factory.mktemp("llama-bin")
    llama.config.save_pretrained(path)
    torch.save(llama.state_dict(), path / "pytorch_model.bin")
    out["llama-gqa-301-bin"] = (llama, path)
    return out


@pytest.fixture(scope="module")
def jobs(checkpoints) -> dict[str, Job]:
    path = {name: str(p) for name, (_, p) in checkpoints.items()}
    listed = [Job(name, path[name]) for name in ("gpt-tied-301", "gpt-untied", "llama-gqa-301",
                                                 "qwen2-bias-301")]
    listed += [Job("llama-gqa-301-bin", path["llama-gqa-301-bin"]),
               Job("gpt-tied-301-last-stage", path["gpt-tied-301"], lo=1),
               Job("gpt-tied-301-random", path["gpt-tied-301"], random=True),
               Job("llama-gqa-301-random", path["llama-gqa-301"], random=True)]
    return {j.name: j for j in listed}


@pytest.fixture(scope="module")
def ranks(jobs) -> dict[tuple[int, str], dict]:
    t0 = time.monotonic()
    out = run_ranks(list(jobs.values()))
    print(f"\n{TP} ranks ran {len(jobs)} models in {time.monotonic() - t0:.1f} s")
    return out


ALL = ["gpt-tied-301", "gpt-untied", "llama-gqa-301", "qwen2-bias-301", "llama-gqa-301-bin",
       "gpt-tied-301-last-stage", "gpt-tied-301-random", "llama-gqa-301-random"]


@pytest.mark.parametrize("name", ALL)
def test_every_rank_gets_the_unsharded_logits(name, jobs, ranks):
    expected = hybrid_logits(build(jobs[name], Unsharded()), 1)  # [17, vocab]
    assert expected.shape == (17, 301 if "301" in name else 300)
    for rank in range(TP):
        got = torch.from_numpy(ranks[(rank, name)]["logits"])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["gpt-tied-301", "gpt-untied", "llama-gqa-301",
                                  "qwen2-bias-301"])
def test_tp_logits_equal_transformers(name, checkpoints, ranks):
    """Rows: the decodes of requests 1 and 2, then request 0's chunk [10, 25)."""
    model, _ = checkpoints[name]
    p = prompts()
    with torch.no_grad():
        ref = torch.cat([model(torch.tensor([p[1]])).logits[0, -1:],
                         model(torch.tensor([p[2]])).logits[0, -1:],
                         model(torch.tensor([p[0]])).logits[0, 10:25]])
    got = torch.from_numpy(ranks[(0, name)]["logits"])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ALL)
def test_each_rank_holds_exactly_its_slice(name, ranks):
    """Loaded or random-initialized, rank r's parameters are its `Shard` of the unsharded
    model's, and the cut parameters really are cut."""
    qkv_rows = 3 * 64 if name.startswith("gpt") else 64 + 2 * (2 * 8)  # k, v: 2 heads of 8
    for rank in range(TP):
        report = ranks[(rank, name)]
        assert report["not_a_slice"] == []
        shapes = report["shapes"]
        assert shapes["layers.0.qkv.weight"] == (qkv_rows // TP, 64)
        assert shapes["layers.0.out.weight"] == (64, 64 // TP)
        if name.startswith("qwen2"):  # q/k/v biases cut like their rows; none on o or the MLP
            assert shapes["layers.0.qkv.bias"] == (qkv_rows // TP,)
            assert not {"layers.0.out.bias", "layers.0.fc1.bias"} & set(shapes)
        head = shapes.get("lm_head.weight", shapes.get("embed.weight"))  # tied: one tensor
        assert head == ((302 if "301" in name else 300) // TP, 64)  # 301 padded to 302


@pytest.mark.parametrize("name", ["gpt-tied-301", "gpt-untied", "llama-gqa-301",
                                  "qwen2-bias-301", "gpt-tied-301-last-stage"])
def test_each_rank_reads_only_its_slices(name, jobs, ranks):
    """The elements each rank reads from the safetensors files are exactly the ones it
    holds (padding aside): about half the stage's weights, never a whole cut tensor."""
    whole = sum(p.numel() for p in build(jobs[name], Unsharded()).parameters())
    for rank in range(TP):
        read = ranks[(rank, name)]["read"]
        assert read == ranks[(rank, name)]["held"]
        assert whole / TP < read < 0.6 * whole  # replicated norms, biases, positions: a little more


def test_shard_ranges_cut_each_part_and_pad_the_vocabulary():
    qkv = Shard(0, (8, 4, 4), 0, tp=2, rank=1)  # rank 1's q, k, v rows
    assert qkv.ranges() == [(4, 8, 0), (10, 12, 0), (14, 16, 0)]
    assert qkv.take(torch.arange(16.0)).tolist() == [4, 5, 6, 7, 10, 11, 14, 15]
    vocab = Shard(0, (5,), pad=1, tp=2, rank=1)  # 5 rows padded to 6: rank 1 has 3, 4 and a 0
    assert vocab.ranges() == [(3, 5, 1)]
    assert vocab.take(torch.arange(1.0, 6.0)).tolist() == [4, 5, 0]
    assert Shard(0, (5,), pad=3, tp=4, rank=3).ranges() == [(5, 5, 2)]  # all padding
    row = Shard(1, (6,), tp=3, rank=2)
    assert row.full_shape(torch.Size([4, 2])) == (4, 6)
    assert row.take(torch.arange(24.0).view(4, 6))[0].tolist() == [4, 5]


def test_children_are_gone(ranks):
    assert multiprocessing.active_children() == []
