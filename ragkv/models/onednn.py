"""Exact copies of a model's linears through oneDNN, and the per-machine choice of kernel for each product.

`OneDnnLinear` runs a linear (or several reading one input, joined) on the model's own weights: fp32 through oneDNN in
place; bf16 through whichever kernel `choose_kernels` measured fastest on this machine for that product and row
count: ragkv's kernels on a packed copy for decode rows (ops/gemv_kernel, ops/amx_kernel), amx_kernel's `gemm` for a
prefill's rows (on a copy of its own, with SwiGLU or the residual add fused), oneDNN on
W in place, torch's stock `F.linear`, and oneDNN on a copy reordered into its blocked layout (the AMX layout, so no
reorder per call), whole or in 512-row tiles. Those two copies are made only for products that time or chose them.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ragkv.config import cpu_has_fast_bf16
from ragkv.ops import amx_kernel, gemv_kernel, int8_kernel
from ragkv.ops.attention import choose_decode_attention, choose_prefill_attention
from ragkv.ops.kernel_choice import PROBE_ROWS, KernelChooser, row_class

log = logging.getLogger(__name__)

FEW_ROWS = 512  # an exact copy's kernels beat MKL's up to about this many rows (Zen 3); more are sliced or go to MKL
TILE_ROWS = 512  # the "tiles" kernel's tile: where oneDNN's bf16 product held its rate on an AMX Xeon (kernel_choice)
PACK_ROWS = 16  # the rows oneDNN's bf16 reorder is tuned for: as fast as 1 at decode, 1.7x faster than 1 at 512 rows


def _joined_in_place(parts: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias of linears reading the same input as one (outputs concatenated), without a copy: the
    first time, their parameters are moved into one buffer and each becomes a view of its rows (same values, so
    every path reading them is unchanged); later calls find them there."""
    tensors = [[m.weight for m in parts]] + ([[m.bias for m in parts]] if parts[0].bias is not None else [])
    joined = []
    for ts in tensors:
        if len(ts) > 1 and not _consecutive_views(ts):
            whole = torch.cat([t.detach() for t in ts])
            at = 0
            for t in ts:
                t.data = whole[at:at + t.shape[0]]
                at += t.shape[0]
        first = ts[0].detach()  # already joined: the buffer is the first part's view stretched over all the rows
        joined.append(first.as_strided((sum(t.shape[0] for t in ts),) + tuple(first.shape[1:]), first.stride()))
    return joined[0], joined[1] if len(joined) > 1 else None


def _consecutive_views(ts: list[torch.Tensor]) -> bool:
    """Whether these tensors are back-to-back row ranges of one contiguous buffer (a joined linear's parts)."""
    at = ts[0].storage_offset()
    for t in ts:
        if t.untyped_storage().data_ptr() != ts[0].untyped_storage().data_ptr() or t.storage_offset() != at \
                or not t.is_contiguous():
            return False
        at += t.numel()
    return True


class ExactCopyLinear(nn.Module):
    """A linear (or several fused) whose few-row products read the model's own weights through a faster kernel or
    layout (`few_rows`); a product of more rows goes to `many_rows`: the model's linears by default."""

    def __init__(self, linear: nn.Linear | list[nn.Linear]):
        super().__init__()
        self.parts = linear if isinstance(linear, list) else [linear]  # a plain list: not submodules, not saved
        self.in_features = self.parts[0].in_features
        self.out_features = sum(m.out_features for m in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        return self.few_rows(x) if rows <= FEW_ROWS else self.many_rows(x)

    def many_rows(self, x: torch.Tensor) -> torch.Tensor:
        ys = [nn.functional.linear(x, m.weight, m.bias) for m in self.parts]
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)


def bf16_matrix_units() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX), where oneDNN's packed bf16 kernels pay;
    elsewhere bf16 is emulated and slow."""
    return torch.backends.mkldnn.is_available() and cpu_has_fast_bf16()


class OneDnnLinear(ExactCopyLinear):
    """y = x W^T (+ b) through oneDNN's kernel (see the module docstring), on the model's own W read in place (no
    copy; fused linears are one product over their joined weights, which their parameters view). bf16: products of
    up to gemv_kernel.MAX_ROWS rows (decode) run on a copy of W packed for ragkv's bandwidth-bound kernel
    (ragkv.ops.gemv_kernel); where that kernel is not built, on a copy reordered into oneDNN's blocked layout. Where
    the packed copy exists, a second copy in oneDNN's blocked layout may serve the "blocked" kernel: made when the
    chooser times it or chose it (an AMX Xeon: 1.2-1.4x the in-place rate at 128-512 rows, which reorders W at every
    call), dropped where no row class runs on it."""

    def __init__(self, linear: nn.Linear | list[nn.Linear]):
        super().__init__(linear)
        self.weight, self.bias = _joined_in_place(self.parts)
        self.kernels: list[str] | None = None  # bf16: the kernel per row class, measured (choose_kernels)
        self.gemv = None
        self.blocked: list[torch.Tensor] | None = None  # oneDNN's blocked copy: one per part of a gate/up pair
        self.blockable = False  # whether the blocked copy may be made (built when first timed or chosen)
        self.tiles: tuple[torch.Tensor, torch.Tensor] | None = None  # amx_kernel.gemm's copy, made as `blocked` is
        # a joined gate/up (two parts of one size) is copied paired, so that `gemm` writes SwiGLU from its sums
        self.paired = len(self.parts) == 2 and self.parts[0].out_features == self.parts[1].out_features \
            and self.parts[0].out_features % 16 == 0
        if self.weight.dtype == torch.bfloat16:
            if gemv_kernel.packable(self.weight):
                self.gemv = gemv_kernel.pack(self.weight, self.bias)
                self.blockable = True
            else:
                self.weight = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_ROWS)
        # W in place (not oneDNN's reordered tensor, which cannot be viewed), K a multiple of 32, built here
        self.tileable = self.weight.dtype == torch.bfloat16 and self.weight.device.type == "cpu" \
            and not self.weight.is_mkldnn and (len(self.parts) != 2 or self.paired) \
            and amx_kernel.gemm_takes(amx_kernel.GEMM_MIN_ROWS, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.bfloat16:
            kernel = self.kernel_for(x)
            if kernel == "tiles":
                return self._in_tiles(self.few_rows, x)
            if kernel == "blocked":
                return self._in_tiles(self._blocked, x)
            if kernel == "gemv":
                return gemv_kernel.gemv(x, *self.gemv, self.out_features)
            if kernel == "amx":  # the matrix unit over the same packed copy
                return amx_kernel.product(x, self.gemv[0], self.gemv[2], self.out_features)
            if kernel == "amx_gemm":  # ... many rows at a time, on a copy of its own
                return amx_kernel.gemm(x, *self.tiles_copy(), self.out_features, paired=self.paired)
            if kernel == "stock":  # torch's own product (oneDNN picks AMX by itself where there is one)
                return nn.functional.linear(x, self.weight, self.bias)
            return self.few_rows(x)
        return super().forward(x)

    def kernel_for(self, x: torch.Tensor) -> str:
        return self.kernel_for_rows(x.numel() // self.in_features)

    def kernel_for_rows(self, rows: int) -> str:
        """bf16: "gemv" (ragkv's product kernel, few rows), "amx" (ragkv's AMX kernel on gemv's copy, up to
        amx_kernel.MAX_ROWS rows), "amx_gemm" (its many-row kernel, with the op fused), "onednn" (oneDNN on W in
        place), "stock" (F.linear), "tiles" (oneDNN on W in place over TILE_ROWS-row tiles, more rows only) or
        "blocked" (oneDNN on its blocked copy, in tiles of TILE_ROWS rows): what `choose_kernels` measured fastest
        for this many rows, else gemv wherever it takes the rows."""
        if self.kernels is not None:
            kernel = self.kernels[row_class(rows)]
            if self.takes(kernel, rows):
                return kernel
        return "gemv" if self.takes("gemv", rows) else "onednn"

    def takes(self, kernel: str, rows: int) -> bool:
        """Whether `kernel` can run a product of this many rows on this copy (what the chooser may time)."""
        if kernel == "gemv":
            return self.gemv is not None and rows <= gemv_kernel.MAX_ROWS
        if kernel == "amx":
            return self.gemv is not None and amx_kernel.takes(rows, self.in_features)
        if kernel == "amx_gemm":
            return self.tileable and amx_kernel.gemm_takes(rows, self.in_features)
        if kernel == "blocked":
            return self.blockable
        if kernel in ("stock", "tiles") and self.weight.is_mkldnn:
            return False
        return kernel != "tiles" or rows > TILE_ROWS

    def fuses_post_ops(self) -> bool:  # oneDNN's fused SwiGLU / residual add: bf16 on the model's own weights
        return self.weight.dtype == torch.bfloat16 and not self.weight.is_mkldnn

    def _post_op_kernel(self, rows: int) -> str | None:
        """The kernel chosen for these rows where it runs SwiGLU / the residual add inside oneDNN's products
        ("onednn", "tiles" or "blocked"), else None."""
        kernel = self.kernel_for_rows(rows)
        if kernel == "blocked" or (kernel in ("onednn", "tiles") and self.fuses_post_ops()):
            return kernel
        return None

    def _in_tiles(self, op, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`op` (a product, with the residual it adds) over TILE_ROWS-row tiles of x, joined: each tile at the size
        oneDNN's kernel is fast at, whatever the total."""
        x2 = x.reshape(-1, self.in_features)
        r2 = residual.reshape(x2.shape[0], -1) if residual is not None else None
        tiles = [op(x2[a:a + TILE_ROWS]) if r2 is None else op(x2[a:a + TILE_ROWS], r2[a:a + TILE_ROWS])
                 for a in range(0, x2.shape[0], TILE_ROWS)]
        return (tiles[0] if len(tiles) == 1 else torch.cat(tiles)).reshape(*x.shape[:-1], -1)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x Wg^T) * (x Wu^T) for joined gate/up linears (SwiGLU). Where "amx_gemm" was chosen: one pass writing
        silu(gate) * up from the accumulators (ops/amx_kernel.py). At many rows in bf16: on the blocked copy,
        the two products, then silu(gate) * up in one pass; in place, oneDNN applies silu to the gate's product and
        multiplies the up product by it as each is written. Otherwise the joined product, then silu(gate) * up in
        one pass where that kernel is built (int8_kernel.silu_mul: torch's ops pass over [rows, I] three times),
        else torch's ops."""
        rows = x.numel() // self.in_features
        if self.paired and self.kernel_for_rows(rows) == "amx_gemm":
            return amx_kernel.gemm(x, *self.tiles_copy(), self.out_features // 2, swiglu=True)
        kernel = self._post_op_kernel(rows) if len(self.parts) == 2 else None
        if kernel is not None:
            op = self._blocked_swiglu if kernel == "blocked" else self._fused_swiglu
            return op(x) if kernel == "onednn" else self._in_tiles(op, x)
        y = self(x)
        fused = int8_kernel.silu_mul(y) if len(self.parts) == 2 else None
        if fused is not None:
            return fused
        gate, up = y.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + x W^T (+ b): at many rows in bf16 oneDNN (or "amx_gemm") adds the residual as it writes the
        product."""
        rows = x.numel() // self.in_features
        if len(self.parts) == 1 and self.kernel_for_rows(rows) == "amx_gemm" and residual.dtype == x.dtype:
            return amx_kernel.gemm(x, *self.tiles_copy(), self.out_features, residual=residual)
        kernel = self._post_op_kernel(rows) if len(self.parts) == 1 else None
        if kernel is not None and residual.dtype == x.dtype and residual.is_contiguous():
            op = self._blocked_add if kernel == "blocked" else self._fused_add
            return op(x, residual) if kernel == "onednn" else self._in_tiles(op, x, residual)
        return residual + self(x)

    def mlp_add_to(self, down: nn.Module, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """residual + down(SwiGLU(x)) tile by tile where this gate/up product runs in tiles, each tile's [rows, I]
        intermediate straight into the down projection (AMX Xeon, 1,329 rows: 0.62x the time of joining the SwiGLU
        tiles, then one down projection). None where it does not apply: the caller runs the two steps."""
        rows = x.numel() // self.in_features
        kernel = self._post_op_kernel(rows) if len(self.parts) == 2 else None
        if kernel not in ("tiles", "blocked") or rows <= TILE_ROWS or not isinstance(down, OneDnnLinear) \
                or residual.dtype != x.dtype or not residual.is_contiguous():
            return None
        if down.kernel_for_rows(min(rows, TILE_ROWS)) == "amx_gemm":  # the tiles' rows, as each tile runs
            add = lambda s, r: down.add_to(r, s)  # noqa: E731
        elif down._post_op_kernel(rows) == "blocked":
            add = down._blocked_add
        elif down.fuses_post_ops():
            add = down._fused_add
        else:
            return None
        swiglu = self._blocked_swiglu if kernel == "blocked" else self._fused_swiglu
        return self._in_tiles(lambda xt, rt: add(swiglu(xt), rt), x, residual)

    def _fused_swiglu(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.ops.mkldnn._linear_pointwise(x, self.parts[0].weight, None, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, gate, self.parts[1].weight, None, "mul")

    def _fused_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")

    def blocked_copy(self) -> list[torch.Tensor]:
        """oneDNN's blocked copy, made on first need: a gate/up pair part by part (SwiGLU multiplies the two products
        in one pass, no [rows, 2I] join). Made only for products the chooser times or chose it for: a start whose
        choices come from the cache reorders no weights it will not run on (the 0.5B's LM head alone is 272 MB)."""
        if self.blocked is None:
            weights = [m.weight for m in self.parts] if len(self.parts) == 2 else [self.weight]
            self.blocked = [torch.ops.mkldnn._reorder_linear_weight(w.detach(), TILE_ROWS) for w in weights]
        return self.blocked

    def drop_blocked(self) -> None:
        """No row class runs on the blocked copy: free it, and offer it no more."""
        self.blocked, self.blockable = None, False

    def tiles_copy(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`amx_gemm`'s copy (amx_kernel.pack_tiles), made on first need as the blocked copy is."""
        if self.tiles is None:
            self.tiles = amx_kernel.pack_tiles(self.weight, self.bias, paired=self.paired)
        return self.tiles

    def drop_tiles(self) -> None:
        self.tiles, self.tileable = None, False

    def _blocked_parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each blocked weight's product (the whole linear, or gate and up)."""
        blocked = self.blocked_copy()
        biases = [None] * len(blocked) if self.bias is None else self.bias.split([w.shape[0] for w in blocked])
        return [torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "") for w, b in zip(blocked, biases)]

    def _blocked(self, x: torch.Tensor) -> torch.Tensor:
        ys = self._blocked_parts(x)
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)

    def _blocked_swiglu(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._blocked_parts(x)
        fused = int8_kernel.silu_mul_pair(gate, up)
        return fused if fused is not None else nn.functional.silu(gate) * up

    def _blocked_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.blocked_copy()[0], self.bias, "add")

    def few_rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def many_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Slices of FEW_ROWS rows: oneDNN's kernel at its best shape beats MKL's one product of them all."""
        x2 = x.reshape(-1, self.in_features)
        y = torch.cat([self.few_rows(x2[a:a + FEW_ROWS]) for a in range(0, x2.shape[0], FEW_ROWS)])
        return y.reshape(*x.shape[:-1], self.out_features)


# the op each product feeds (what is timed: oneDNN fuses SwiGLU and the residual add into its own product)
PRODUCT_OPS = {"gate_up_proj": "swiglu", "o_proj": "add", "down_proj": "add"}
KERNELS = ("gemv", "amx", "amx_gemm", "onednn", "stock", "tiles", "blocked")


def _onednn_linears(module: nn.Module, name: str = ""):
    """(attribute name, OneDnnLinear) of every product of a decode copy: children, and the fused ones kept as plain
    attributes (qkv_proj, gate_up_proj)."""
    for attr, value in list(module.__dict__.items()) + list(module._modules.items()):
        if isinstance(value, OneDnnLinear):
            yield attr, value
        elif isinstance(value, nn.Module) and attr in module._modules:
            yield from _onednn_linears(value, attr)


def _probe(m: OneDnnLinear, op: str, kernel: str, down: OneDnnLinear | None = None):
    """rows -> a call running product `m` (and its op; "mlp": with its `down` projection) through `kernel` on that
    many random rows, or None where the kernel cannot take them."""
    def make(rows: int):
        if not m.takes(kernel, rows):
            return None
        x = torch.randn(1, rows, m.in_features, dtype=m.weight.dtype)
        res = torch.randn(1, rows, (down or m).out_features, dtype=m.weight.dtype)

        def run():
            if op == "mlp":  # as MLP.add_to runs it: what the tiles save in the down projection counts
                out = m.mlp_add_to(down, res, x)
                return out if out is not None else down.add_to(res, m.swiglu(x))
            return m.swiglu(x) if op == "swiglu" else m.add_to(res, x) if op == "add" else m(x)

        def call():
            saved, m.kernels = m.kernels, [kernel] * len(PROBE_ROWS)
            try:
                with torch.inference_mode():
                    return run()
            finally:
                m.kernels = saved
        return call
    return make


def choose_kernels(copy_: nn.Module, chooser: KernelChooser) -> None:
    """Each bf16 product of a `onednn` copy gets the kernel measured fastest per row class on this machine (one
    measurement per weight shape and op, cached by `chooser`), and so do its prefills' causal attention and its decode
    attention's path."""
    choices: dict[str, list[str]] = {}
    # a gate/up product is timed with its MLP's down projection (whose kernels are chosen first: it runs by them)
    downs = {id(mod.__dict__.get("gate_up_proj")): mod.down_proj for mod in copy_.modules()
             if isinstance(getattr(mod, "down_proj", None), OneDnnLinear)}
    for attr, m in sorted(_onednn_linears(copy_), key=lambda am: id(am[1]) in downs):
        down = downs.get(id(m)) if attr == "gate_up_proj" and len(m.parts) == 2 else None
        op = "mlp" if down is not None else PRODUCT_OPS.get(attr, "plain")
        layout = "gemv-packed" if m.gemv is not None else "reordered" if m.weight.is_mkldnn else "plain"
        product = f"{op} {m.in_features}->{m.out_features} parts={len(m.parts)} bias={m.bias is not None} {layout}"
        if product not in choices:
            # the probe's cost bound reads the chosen product's MACs alone: an MLP's 1,024-row probe stays measured
            choices[product] = chooser.choose(product, m.weight.dtype, m.in_features * m.out_features,
                                              {k: _probe(m, op, k, down) for k in KERNELS}, "onednn",
                                              with_copy=("blocked", "amx_gemm"))
        m.kernels = choices[product]
        if "blocked" not in m.kernels:  # the copies no row class runs on
            m.drop_blocked()
        elif m.blockable:  # made now, at load, not at the first request's product
            m.blocked_copy()
        if "amx_gemm" not in m.kernels:
            m.drop_tiles()
        elif m.tileable:
            m.tiles_copy()
    args = getattr(copy_, "args", None)
    if args is not None:  # and its attention: the prefills' (ragkv's kernel or SDPA), decode's (AVX-512 or AMX)
        choose_prefill_attention(chooser, torch.bfloat16, args.num_heads, args.num_kv_heads, args.head_dim)
        choose_decode_attention(chooser, torch.bfloat16, args.num_heads, args.num_kv_heads, args.head_dim)
    if chooser.measured:
        chooser.save()
        log.info("kernels measured for %d products on this machine (%s)", chooser.measured, chooser.path)
