"""CPU fast paths: prepacked linear layers and a decode-attention kernel (docs/performance.md).

`prepack_linears` swaps every `nn.Linear` of a loaded model for a `PackedLinear`: the
weight reordered once into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`,
what inductor's freezing pass does for a compiled model on a CPU), so each matmul streams
it instead of re-blocking it per call. On one core of this machine's AVX-512 EPYC it runs a
GPT-2 layer's matmuls 1.2x (256 rows) to 1.7x (8 rows, a decode micro-batch) faster, and
the 50257-row LM head 2.3x faster at 8 rows. Results differ from `F.linear` (MKL) by fp32
rounding (~1e-6 relative); greedy tokens still equal transformers' in the test suite.

Only plain `nn.Linear`s are packed (tp = 1 stages and the profiler's `LocalShard`):
Megatron-core's parallel layers (tp > 1) keep their own matmuls. A packed layer has no
dense weight any more, so packing comes after the weights are loaded and checked.
"""
from __future__ import annotations

import contextlib
import functools
import os
import shutil
import warnings
from pathlib import Path

import torch
from torch import nn

from pp_runtime.config import Config

PACK_ROWS_HINT = 64  # oneDNN's batch-size hint; one packing serves every row count


def use_prepack(cfg: Config, device: torch.device) -> bool:
    """Whether a stage (and the profile) of `cfg` on `device` packs its linear layers."""
    return cfg.runtime.prepack and device.type == "cpu"


def use_decode_kernel(cfg: Config, device: torch.device) -> bool:
    """Whether a stage (and the profile) of `cfg` on `device` runs decodes through the C++
    kernel: asked for, on a CPU, and built (the first call builds it)."""
    return cfg.runtime.cpu_decode_kernel and device.type == "cpu" and decode_extension() is not None


@functools.cache
def can_prepack(dtype: torch.dtype) -> bool:
    """Whether this torch and CPU run oneDNN linears in `dtype` (bf16 needs AVX-512 bf16)."""
    if not torch.backends.mkldnn.is_available() or dtype not in (torch.float32, torch.bfloat16):
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:  # a tiny layer, checked against the plain one
        w, x = torch.randn(8, 16, dtype=dtype), torch.randn(3, 16, dtype=dtype)
        got = PackedLinear.from_linear(_linear_of(w))(x)
        return torch.allclose(got.float(), (x @ w.t()).float(), atol=1e-2, rtol=1e-2)
    except (RuntimeError, AttributeError):
        return False


def _linear_of(w: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    layer.weight = nn.Parameter(w, requires_grad=False)
    return layer


class PackedLinear(nn.Module):
    """y = x @ W.T + b on a oneDNN-blocked W. `weight` is the packed tensor (its shape is
    nn.Linear's [out_features, in_features]); x: [..., in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight, self.bias = weight, bias  # plain attributes: nothing to load or train

    @classmethod
    @torch.no_grad()
    def from_linear(cls, layer: nn.Linear) -> "PackedLinear":
        w = layer.weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_ROWS_HINT)
        bias = None if layer.bias is None else layer.bias.detach().contiguous()
        return cls(packed, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        y = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed"


def prepack_linears(model: nn.Module) -> int:
    """Replace every CPU `nn.Linear` of `model` (in a dtype `can_prepack` takes) by its
    `PackedLinear`, in place; returns how many were packed. Each dense weight is freed as
    its packed copy is made, except one shared with another module (a tied LM head is
    packed as a copy: the embedding keeps the dense one)."""
    # (parent, name) only: holding the children would keep every dense weight alive
    sites = [(parent, name) for parent in model.modules()
             for name, child in parent.named_children() if type(child) is nn.Linear]
    count = 0
    for parent, name in sites:
        w = getattr(parent, name).weight
        if w.device.type == "cpu" and not w.is_meta and can_prepack(w.dtype):
            setattr(parent, name, PackedLinear.from_linear(getattr(parent, name)))
            count += 1
        del w  # the dense weight goes with its layer: one layer's packed copy at most extra
    return count


# ---- decode attention: one C++ call per layer for every decode (csrc/decode_attention.cpp)
_SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
_FLAGS = ["-O3", "-march=native", "-fopenmp"]  # torch's intra-op threads are OpenMP's


@functools.cache
def decode_extension():
    """The compiled decode-attention kernel, or None where it cannot be built (no C++
    compiler or ninja; the reason is warned once). Built on first use into torch's
    extension cache (~/.cache/torch_extensions; TORCH_EXTENSIONS_DIR moves it), about 17 s
    on this machine's two cores, then loaded in well under a second. The name carries a hash
    of the source, the flags and this CPU's model, so an edit or another node's CPU (with
    `-march=native`) gets its own build and a shared home directory is safe. It is compiled
    from a copy of the source kept in its build directory: torch's ninja file names the
    source's path, and the same source at another path (a second checkout, a wheel install)
    would rebuild it every time the two alternate."""
    import hashlib
    import platform

    from torch.utils import cpp_extension

    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else platform.processor()
    model = next((line for line in cpu.splitlines() if line.startswith(("model name", "flags"))), cpu)
    key = hashlib.sha1(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + model.encode()).hexdigest()[:10]
    name = f"pp_runtime_decode_{key}"
    try:
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        with _build_lock(build_dir):
            source = build_dir / _SOURCE.name  # the name's hash covers its content
            if not source.exists():
                tmp = source.with_suffix(f".{os.getpid()}.tmp")
                shutil.copyfile(_SOURCE, tmp)
                tmp.replace(source)
            return cpp_extension.load(name, [str(source)], extra_cflags=_FLAGS,
                                      extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, a failed build: the SDPA path runs
        warnings.warn(f"pp_runtime: the CPU decode-attention kernel could not be built "
                      f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                      "decodes use one SDPA call each (runtime.cpu_decode_kernel)", stacklevel=2)
        return None


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """torch's build lock is a file (`lock`) that a killed build leaves behind, and every
    later load then waits on it for ever (a Ray actor that never starts). An flock, which
    the kernel drops with the process, serialises our builds instead; whoever holds it
    removes a `lock` file left by a dead build before torch looks at it."""
    import fcntl

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "pp_runtime.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield


def decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         tables: torch.Tensor, lens: torch.Tensor,
                         window: int | None = None) -> torch.Tensor:
    """Every decode in one call: q [D, heads, head_dim]; caches [num_blocks, block_size,
    kv_heads, head_dim] (either layout); tables [D, W] int32 block tables, lens [D] int32;
    with a sliding `window`, each decode reads only its last `window` keys.
    Returns [D, heads, head_dim]."""
    return decode_extension().decode_attention(q, k_cache, v_cache, tables, lens,
                                               q.shape[-1] ** -0.5, window or 0)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights: its parameters plus its `PackedLinear`s' packed weights
    and biases (which are not parameters). A tied LM head, once packed, counts twice: the
    packed copy is real memory beside the embedding's dense weight."""
    packed = [t for m in model.modules() if isinstance(m, PackedLinear)
              for t in (m.weight, m.bias) if t is not None]
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *packed])
