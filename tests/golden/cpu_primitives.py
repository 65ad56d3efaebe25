"""The CPU primitives of the default campaign, each hashed on fixed seeded inputs.

Run in a fresh process (the CPU-numerics variable must be set before torch loads):

    PYTHONPATH=$PWD .venv/bin/python tests/golden/cpu_primitives.py          # print the hashes
    PYTHONPATH=$PWD .venv/bin/python tests/golden/cpu_primitives.py --write  # regenerate the committed file

Each line is one primitive (a GEMM under the BF16 rule, attention, a transcendental, the tiny
model's forward and backward, the optimizer step, sampling, ...) computed as the default
campaign computes it (``precision.cpu_bf16_gemm: portable``, ATen's AVX2 kernels, the preset's
2 threads) and the hash of its outputs. ``tests/fp8rl_core/cpu_numerics/test_cpu_portable.py`` compares them with
``cpu_primitive_hashes.txt``: a CPU whose numbers differ fails naming the primitives, and a
2-step campaign that dispatches an arithmetic ATen op no primitive here covers fails too.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
HASHES = HERE / "cpu_primitive_hashes.txt"
THREADS = 2  # the preset's (configs/tiny-cpu.yaml): reductions split by thread count


def _hash(out) -> str:
    import torch

    if isinstance(out, (tuple, list)):
        return hashlib.sha256("+".join(_hash(x) for x in out).encode()).hexdigest()[:12]
    t = out.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    elif t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t = t.view(torch.uint8)
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:12]


def _gen(seed: int, *shape, scale: float = 1.0, dtype=None):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    return x if dtype is None else x.to(dtype)


def _grads(fn, *inputs):
    """fn(*inputs) and the gradients of a fixed weighted sum of it w.r.t. every input."""
    import torch

    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    weight = _gen(99, *out.shape).to(out.dtype)
    grads = torch.autograd.grad((out.float() * weight.float()).sum(), leaves)
    return (out, *grads)


def _gemm_primitives() -> dict[str, Callable]:
    import torch
    import torch.nn.functional as F

    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731

    def under_bf16(fn):
        def run(*a, **kw):
            with bf16():
                return fn(*a, **kw)

        return run

    x, w, b = _gen(1, 6, 37, 128), _gen(2, 384, 128, scale=0.05), _gen(3, 384)
    big = _gen(4, 9000, 16)  # an inner dimension beyond one exact chunk
    q, k, v = (_gen(s, 2, 4, 24, 32) for s in (5, 6, 7))
    mask = torch.ones(24, 24, dtype=torch.bool).tril()
    return {
        "linear bf16 rule fwd+bwd": lambda: _grads(under_bf16(F.linear), x, w, b),
        "matmul bf16 rule 3d fwd+bwd": lambda: _grads(under_bf16(torch.matmul), x, w.t()),
        "addmm bf16 rule": lambda: under_bf16(torch.addmm)(b, x[0], w.t()),
        "bmm bf16 rule": lambda: under_bf16(torch.bmm)(q[0], k[0].transpose(-1, -2)),
        "linear fp32 fwd+bwd": lambda: _grads(F.linear, x, w, b),
        "mm fp32 long inner dim": lambda: torch.mm(big.t(), big),
        "sdpa causal bf16 rule fwd+bwd": lambda: _grads(
            under_bf16(lambda a, b_, c: F.scaled_dot_product_attention(a, b_, c, is_causal=True)), q, k, v
        ),
        "sdpa bool mask bf16 rule": lambda: under_bf16(F.scaled_dot_product_attention)(q, k, v, attn_mask=mask),
        "sdpa causal fp32 fwd+bwd": lambda: _grads(
            lambda a, b_, c: F.scaled_dot_product_attention(a, b_, c, is_causal=True), q, k, v
        ),
        "exact GEMM grid (rows, columns; 1 and 2 levels; BF16 operand)": _grid_primitive,
        "exact GEMM output rounding (float32, BF16)": _finish_primitive,
    }


def _grid_primitive():
    """The exact GEMM's operand grid (the compiled kernel where it runs) on values spanning every exponent."""
    import torch

    from fp8rl_core.cpu_numerics import portable_math as pm

    x = _gen(11, 40, 96) * torch.exp2(_gen(12, 40, 96, scale=12.0).round())
    x[0] = 0.0
    x[1, :8] = 1e-41
    out = []
    for operand, bf16 in ((x, True), (x, False), (x.bfloat16(), False), (x.t().contiguous().t(), True)):
        for dim in (-1, -2):
            for levels in (1, 2):
                grid, up = pm._levels(operand, dim, levels, bf16)
                out += [*grid, up]
    return out


def _finish_primitive():
    """The exact GEMM's last pass: float64 sums rounded to float32, divided by the scales, to BF16."""
    import torch

    from fp8rl_core.cpu_numerics import portable_math as pm

    sums = (_gen(13, 3, 30, 50).double() * 2.0**45).round()
    ua = torch.exp2(_gen(14, 3, 30, 1, scale=40.0).round().clamp(-126, 127))
    ub = torch.exp2(_gen(15, 1, 1, 50, scale=40.0).round().clamp(-126, 127))
    return pm._finish(sums, ua, ub, False), pm._finish(sums, ua, ub, True)


def _math_primitives() -> dict[str, Callable]:
    import torch

    x = _gen(8, 33, 1000, scale=3.0)
    pos = _gen(9, 4096, scale=40.0)
    out = {}
    for dtype in (torch.float32, torch.float64):
        t = x.to(dtype)
        n = str(dtype).replace("torch.", "")
        out[f"exp {n} fwd+bwd"] = lambda t=t: _grads(torch.exp, t)
        out[f"log {n} fwd+bwd"] = lambda t=t: _grads(torch.log, t.abs() + 1e-3)
        out[f"sqrt {n} fwd+bwd"] = lambda t=t: _grads(torch.sqrt, t.abs() + 1e-3)
        out[f"tanh {n} fwd+bwd"] = lambda t=t: _grads(torch.tanh, t)
        out[f"sin cos {n}"] = lambda t=pos.to(dtype): (torch.sin(t), torch.cos(t))
        out[f"logsumexp {n} fwd+bwd"] = lambda t=t: _grads(lambda a: torch.logsumexp(a, -1), t)
        out[f"pow 0.5 and foreach sqrt {n}"] = lambda t=t: (t.abs().pow(0.5), *torch._foreach_sqrt([t.abs()]))
    out["softmax, log_softmax, cross_entropy f32 fwd+bwd"] = lambda: (
        *_grads(lambda a: torch.softmax(a, -1), x),
        *_grads(lambda a: torch.nn.functional.cross_entropy(a, torch.arange(33) % 1000), x),
    )
    out["log_softmax f32 fwd+bwd"] = lambda: _grads(lambda a: torch.nn.functional.log_softmax(a, -1), x)
    out["reductions f32 bf16"] = lambda: (
        x.sum(), x.mean(-1), x.var(-1), x.amax(-1), x.norm(), x.cumsum(-1), x.bfloat16().sum(-1)
    )
    out["accumulations f32 f64"] = lambda: (
        torch.zeros(40, 1000).index_add_(0, torch.arange(33) % 7, x),
        torch.zeros(40, 1000, dtype=torch.float64).index_add_(0, torch.arange(33) % 7, x.double()),
        torch.zeros(33, 1000).scatter_add_(-1, (torch.arange(33)[:, None] * 7) % 1000, x[:, :1]),
        torch.zeros(33, 1000).addcmul_(x, x.flip(-1), value=-1.0),
        torch.zeros(33, 1000).addcdiv_(x, x.abs() + 1.0, value=-0.5),
        x.clone().neg_(),
    )
    out["elementwise f32 f64"] = lambda: (
        x / 3.0,
        x.reciprocal(),
        x.pow(2),
        x.pow(-0.5),
        torch.rsqrt(x.abs() + 1),
        x.clamp(-1, 1),
        torch.sigmoid(x),
        torch.nn.functional.silu(x),
        x.double() * 1.1,
        torch.nextafter(x, x + 1),
        torch.where(x > 0, x, -x),
    )
    out["sort, quantile, bucketize"] = lambda: (
        x.double().sort(-1)[0],
        torch.quantile(x[0], torch.tensor([0.1, 0.5, 0.9])),
        torch.bucketize(x[0], torch.linspace(-3, 3, 7)),
    )
    return out


def _model_primitives() -> dict[str, Callable]:
    import torch

    from fp8rl_core.config.model import ModelConfig
    from fp8rl_core.precision.fp8_linear import Fp8Recipe, Fp8TrainingLinear
    from fp8rl_core.tasks.tiny_model import build_tiny_model

    def model_step(fp8: bool):
        torch.manual_seed(0)
        model = build_tiny_model(ModelConfig(), 64)
        model.model.embed_tokens.to(torch.bfloat16 if fp8 else torch.float32)  # the engines' BF16 copy too
        if fp8:
            for layer in model.model.layers:
                mlp = layer.mlp
                mlp.up_proj = Fp8TrainingLinear.from_linear(mlp.up_proj, Fp8Recipe.named("tensorwise"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), foreach=True)
        ids = torch.randint(3, 64, (4, 20), generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return (loss, *[p.detach() for p in model.parameters()])

    def sampling():
        g = torch.Generator().manual_seed(3)
        probs = torch.softmax(_gen(10, 16, 64, scale=2.0), -1)
        return (
            torch.multinomial(probs, 1, generator=g),
            torch.multinomial(probs, 4, replacement=True, generator=g),
            torch.empty(64).exponential_(generator=g),
            torch.empty(64).uniform_(generator=g),
            torch.empty(64).normal_(generator=g),
            torch.randperm(50, generator=g),
        )

    return {
        "tiny model bf16 step (AdamW foreach, clip)": lambda: model_step(False),
        "tiny model FP8 tensorwise step": lambda: model_step(True),
        "sampling": sampling,
    }


def primitives() -> dict[str, Callable]:
    """Every primitive, by name (computed inside the campaign's numerics context: see :func:`run`)."""
    return {**_gemm_primitives(), **_math_primitives(), **_model_primitives()}


def run(record: Callable | None = None) -> list[str]:
    """Each primitive's line ``name  hash``; ``record(name)`` is entered around each (a recorder of ops)."""
    import torch

    from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm

    torch.set_num_threads(THREADS)
    lines = []
    for name, fn in primitives().items():
        with cpu_bf16_gemm("portable"), (record(name) if record else contextlib.nullcontext()):
            lines.append(f"{name:48s} {_hash(fn())}")
    return lines


def cpu_description() -> str:
    """The CPU's model, family/model numbers and the vector extensions that decide kernels."""
    from flows.campaign.cpu_numerics import cpu_model

    try:
        info = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return cpu_model()
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    have = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return (
        f"{cpu_model()} ({fields.get('vendor_id', '?')}, family {fields.get('cpu family', '?')} "
        f"model {fields.get('model', '?')}; {' '.join(have)})"
    )


def header() -> list[str]:
    import torch

    return [
        f"# torch {torch.__version__}; ATen {torch.backends.cpu.get_cpu_capability()}; {THREADS} threads",
        f"# checked on: {cpu_description()}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description="Hash every CPU primitive of the default campaign.")
    ap.add_argument("--write", action="store_true", help=f"write {HASHES.name}")
    args = ap.parse_args()
    from fp8rl_core.host.cpu_env import pin_cpu_numerics

    pin_cpu_numerics()
    os.environ.pop("FP8RL_MAX_THREADS", None)
    text = "\n".join([*header(), *run()]) + "\n"
    if args.write:
        HASHES.write_text(text)
        print(f"wrote {HASHES}", file=sys.stderr)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()


# --------------------------------------------------------------------------- which ATen ops a run dispatches

# float ops whose CPU bits a library chooses by the CPU (MKL's GEMMs and vector math, oneDNN):
# the default campaign must dispatch none of them on float32/float64 CPU tensors. A float64 mm/bmm
# is the exact GEMM's product of integers (fp8rl_core.cpu_numerics.portable_math): exact, so allowed.
LIBRARY_OPS = frozenset(
    f"aten.{name}"
    for base in (
        "mm", "addmm", "bmm", "baddbmm", "addmv", "mv", "dot", "exp", "log", "log2", "log10", "sin", "cos",
        "tan", "asin", "acos", "atan", "tanh", "erf", "erfc", "erfinv", "sqrt", "trunc", "logsumexp",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    )
    for name in (base, base + "_")
) | {"aten._foreach_sqrt", "aten._foreach_sqrt_", "aten._foreach_exp", "aten._foreach_exp_", "pow 0.5"}
EXACT_FLOAT64 = frozenset({"aten.mm", "aten.bmm", "aten.matmul"})
# ops whose float output is a copy, a selection or a comparison of their inputs: no rounding at all
NO_ARITHMETIC = frozenset(
    "aten." + n
    for n in (
        "view _unsafe_view alias t transpose expand slice select squeeze unsqueeze reshape clone copy_ cat "
        "stack index index_put_ index_select gather masked_fill masked_fill_ where zeros ones full empty "
        "fill_ zero_ _to_copy to detach detach_ lift_fresh set_ new_empty new_zeros new_ones ones_like "
        "zeros_like empty_like full_like constant_pad_nd eq ne lt le gt ge isin nonzero _local_scalar_dense "
        "item is_nonzero abs neg split unbind flip roll embedding slice_backward select_backward unfold "
        "as_strided permute mT contiguous narrow split_with_sizes scalar_tensor arange resolve_conj resolve_neg "
        "maximum minimum max min amax amin aminmax clamp clamp_ clamp_min clamp_min_ clamp_max clamp_max_ "
        "argmax argmin sort topk isnan isinf isfinite logical_not logical_and logical_or any all count_nonzero "
        "masked_select repeat repeat_interleave tril triu empty_strided _unique2 bucketize searchsorted "
        "new_empty_strided expand_as view_as copysign sign nan_to_num"
    ).split()
)


# composite ops a dispatch mode may see beside the kernel they run (the kernel is what the hashes cover)
COMPOSITE_KERNEL = {"aten.log_softmax": "aten._log_softmax", "aten.softmax": "aten._softmax"}


def unhashed(campaign: set[tuple[str, str]], hashed: set[tuple[str, str]]) -> list[str]:
    """The (op, dtype) pairs of a run that do arithmetic and that no primitive's hash covers."""
    out = []
    for op, dt in sorted(campaign):
        covered = (COMPOSITE_KERNEL.get(op, op), dt) in hashed
        exact = op in NO_ARITHMETIC or (dt == "float64" and op in EXACT_FLOAT64)
        if not covered and not exact:
            out.append(f"{op} {dt}")
    return out


def float_ops_recorder():
    """A dispatch mode recording each (ATen op, float dtype) dispatched on CPU tensors; ``pow`` with
    exponent 0.5 (MKL's vector sqrt) is recorded as ``pow 0.5``."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[tuple[str, str]] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = str(func.overloadpacket)
            if name in ("aten.pow", "aten.pow_") and len(args) > 1 and isinstance(args[1], float) and args[1] == 0.5:
                name = "pow 0.5"
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type == "cpu":
                    self.seen.add((name, str(t.dtype).replace("torch.", "")))
            return func(*args, **kwargs)

    return Recorder()


def library_calls(seen: set[tuple[str, str]]) -> list[str]:
    """The recorded (op, dtype) pairs that reach a CPU-dependent library."""
    return sorted(
        f"{op} {dt}"
        for op, dt in seen
        if op in LIBRARY_OPS and dt in ("float32", "float64") and not (dt == "float64" and op in EXACT_FLOAT64)
    )


def hashed_ops() -> set[tuple[str, str]]:
    """Every (op, dtype) the primitives dispatch: what the committed hashes cover."""
    seen: set[tuple[str, str]] = set()

    @contextlib.contextmanager
    def record(name):
        rec = float_ops_recorder()
        with rec:
            yield
        seen.update(rec.seen)

    run(record)
    return seen
