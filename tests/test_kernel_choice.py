"""Kernels chosen by measuring the machine (ragkv.ops.kernel_choice): the choice follows the measurements (a fake
timer), is cached per machine, and every kernel it may pick computes the product the model's own linear does."""

import pytest
import torch

from ragkv.ops.kernel_choice import PROBE_ROWS, KernelChooser, machine_key, row_class
from ragkv.ops import amx_kernel, gemv_kernel

native_bf16 = pytest.mark.skipif(not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()),
                                 reason="bf16 kernels are chosen only where the CPU multiplies bf16 natively")


class FakeClock:
    """A timer whose readings advance by what the kernel being run is said to cost."""

    def __init__(self, costs):
        self.costs, self.now, self.running = costs, 0.0, None

    def __call__(self):
        return self.now

    def kernel(self, name, rows):
        def call():
            self.now += self.costs[name](rows) / 1000
        return call


def test_the_chooser_picks_the_fastest_measured_kernel_per_row_class_and_caches_it(tmp_path):
    costs = {"gemv": lambda r: 0.1 * r, "onednn": lambda r: 0.5 + 0.01 * r, "stock": lambda r: 1.0 + 0.001 * r}
    clock = FakeClock(costs)
    candidates = {name: (lambda name: lambda rows: clock.kernel(name, rows) if name != "gemv" or rows <= 16
                         else None)(name) for name in costs}
    chooser = KernelChooser(tmp_path / "k.json", timer=clock)
    choice = chooser.choose("plain 8->8", torch.bfloat16, 64, candidates, "onednn")
    # 1 row: gemv 0.1; 4: gemv 0.4; 16: onednn 0.66 < gemv 1.6; 128: onednn 1.78 > stock 1.128; 512, 1024: stock
    assert choice == ["gemv", "gemv", "onednn", "stock", "stock", "stock"] and chooser.measured == 1
    chooser.save()
    again = KernelChooser(tmp_path / "k.json", timer=lambda: pytest.fail("measured again"))
    assert again.choose("plain 8->8", torch.bfloat16, 64, candidates, "onednn") == choice and again.measured == 0
    entry = next(iter(again.table.values()))
    assert entry["machine"] == machine_key(torch.bfloat16) and torch.__version__ in entry["machine"]
    assert entry["ms"][0]["gemv"] == pytest.approx(0.1) and "gemv" not in entry["ms"][4]
    fresh = KernelChooser(tmp_path / "k.json", timer=clock, refresh=True)  # `bench kernels --refresh`
    assert fresh.choose("plain 8->8", torch.bfloat16, 64, candidates, "onednn") == choice and fresh.measured == 1
    # another dtype is another machine key: measured on its own
    assert chooser.choose("plain 8->8", torch.float32, 64, candidates, "onednn") == choice and chooser.measured == 2


def test_an_emulated_older_cpu_is_another_machine_with_fewer_kernels(monkeypatch):
    """scripts/as_avx2.sh runs a command down an AVX2-only CPU's paths: what is past AVX2 is off for ragkv's kernels,
    the records name both the paths and the CPU, and choices measured natively are not reused there."""
    from ragkv import config

    monkeypatch.setattr(config, "_cpuinfo", lambda: ("AMD EPYC", frozenset({"avx2", "avx512f", "avx512_bf16"})))
    native = machine_key(torch.bfloat16)
    assert config.cpu_has("avx512_bf16") and config.cpu_name() == "AMD EPYC (AVX-512 BF16)"
    monkeypatch.setenv(config.EMULATED_ISA, "avx2")
    assert not config.cpu_has("avx512_bf16") and config.cpu_has("avx2") and not config.cpu_has_fast_bf16()
    assert config.cpu_name() == "AMD EPYC (AVX2 paths, emulated on AVX-512 BF16)"
    assert machine_key(torch.bfloat16) != native


def test_candidates_are_timed_in_turn_and_a_copy_must_win_by_a_margin(tmp_path):
    """A probe times every candidate once a round, the order rotating, so a machine that slows down during the
    probe slows all alike (a fake clock whose costs rise 2.5% a call: timed one kernel after the other, the 10%
    slower one timed first would win on the drift); a kernel needing its own copy of the weights is chosen only 5% faster than the rest."""
    from ragkv.ops.kernel_choice import fastest

    calls = []

    class Drifting(FakeClock):
        def kernel(self, name, rows):
            def call():
                calls.append(name)
                self.now += self.costs[name](rows) * 1.025 ** len(calls) / 1000
            return call
    clock = Drifting({"a": lambda r: 1.0, "b": lambda r: 0.9})
    candidates = {n: (lambda n: lambda rows: clock.kernel(n, rows))(n) for n in ("a", "b")}
    choice = KernelChooser(tmp_path / "k.json", timer=clock).choose("plain 4->4", torch.bfloat16, 0, candidates, "a")
    assert choice == ["b"] * len(PROBE_ROWS)
    assert calls[:2] == ["a", "b"] and calls[2:4] == ["a", "b"] and calls[4:6] == ["b", "a"]
    assert fastest({"onednn": 1.0, "blocked": 0.96}, ("blocked",)) == "onednn"
    assert fastest({"onednn": 1.0, "blocked": 0.94}, ("blocked",)) == "blocked"
    assert fastest({"blocked": 0.5}, ("blocked",)) == "blocked"


def test_a_copy_one_class_runs_on_is_taken_by_time_alone_in_the_others(tmp_path):
    """The copy margin weighs memory not yet spent: once a class's margin is cleared, the copy exists and a class
    where it is 2% faster takes it too; where no class clears the margin, none takes it."""
    from ragkv.ops.kernel_choice import choose_per_class

    times = [{"onednn": 1.0, "amx_gemm": 0.7}, {"onednn": 1.0, "amx_gemm": 0.98}, {"onednn": 1.0, "amx_gemm": 1.1}]
    assert choose_per_class(times, "onednn", ("amx_gemm",)) == ["amx_gemm", "amx_gemm", "onednn"]
    assert choose_per_class(times[1:], "onednn", ("amx_gemm",)) == ["onednn", "onednn"]
    # a second copy must still clear the margin against every kernel already held
    both = [{"onednn": 1.0, "amx_gemm": 0.7, "blocked": 0.8}, {"onednn": 1.0, "amx_gemm": 0.98, "blocked": 0.96}]
    assert choose_per_class(both, "onednn", ("amx_gemm", "blocked")) == ["amx_gemm", "amx_gemm"]
    assert choose_per_class([{}, {"onednn": 1.0}], "stock", ("amx_gemm",)) == ["stock", "onednn"]
    # a cached entry is chosen again by this rule, not re-measured
    clock = FakeClock({"onednn": lambda r: 1.0, "amx_gemm": lambda r: 0.7 if r <= 16 else 0.98})
    candidates = {n: (lambda n: lambda rows: clock.kernel(n, rows))(n) for n in ("onednn", "amx_gemm")}
    chooser = KernelChooser(tmp_path / "k.json", timer=clock)
    assert chooser.choose("plain 4->4", torch.bfloat16, 0, candidates, "onednn", ("amx_gemm",)) \
        == ["amx_gemm"] * len(PROBE_ROWS)
    next(iter(chooser.table.values()))["choice"] = ["onednn"] * len(PROBE_ROWS)  # as an older rule stored it
    chooser.save()
    again = KernelChooser(tmp_path / "k.json", timer=lambda: pytest.fail("measured again"))
    assert again.choose("plain 4->4", torch.bfloat16, 0, candidates, "onednn", ("amx_gemm",)) \
        == ["amx_gemm"] * len(PROBE_ROWS)


def test_a_class_too_costly_to_probe_keeps_the_default_and_row_classes_cover_every_count(tmp_path):
    clock = FakeClock({"stock": lambda r: 1.0, "onednn": lambda r: 2.0})
    candidates = {n: (lambda n: lambda rows: clock.kernel(n, rows))(n) for n in ("stock", "onednn")}
    choice = KernelChooser(tmp_path / "k.json", timer=clock).choose("plain big", torch.bfloat16, 10**8, candidates,
                                                                   "onednn")
    assert choice[:1] == ["stock"] and choice[-1] == "onednn"  # 1024 rows x 1e8 MACs: not probed
    assert [row_class(r) for r in (1, 2, 4, 5, 16, 17, 128, 129, 512, 513, 10**6)] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert [row_class(r) for r in PROBE_ROWS] == list(range(len(PROBE_ROWS)))


@native_bf16
@pytest.mark.parametrize("op", ["plain", "swiglu", "add"])
@pytest.mark.parametrize("rows", [1, 3, 16, 40, 600, 1100])
def test_every_kernel_the_chooser_may_pick_computes_the_linear(op, rows, tmp_path):
    """gemv (few rows), the AMX kernels (up to 128 rows, and from 17 on, where the CPU has AMX), oneDNN in place (with its fused SwiGLU
    and residual add, whole or in 512-row tiles), oneDNN on its blocked copy (in 512-row tiles) and torch's stock
    product give the model's own bf16 linear's result to bf16 rounding at every row class."""
    from ragkv.models.onednn import TILE_ROWS, OneDnnLinear

    torch.manual_seed(0)
    parts = [torch.nn.Linear(64, 96, bias=False).to(torch.bfloat16) for _ in range(2 if op == "swiglu" else 1)]
    m = OneDnnLinear(parts if len(parts) > 1 else parts[0])
    x = torch.randn(1, rows, 64, dtype=torch.bfloat16)
    res = torch.randn(1, rows, m.out_features, dtype=torch.bfloat16)
    y = [torch.nn.functional.linear(x.float(), p.weight.float()) for p in parts]
    want = torch.nn.functional.silu(y[0]) * y[1] if op == "swiglu" else res.float() + y[0] if op == "add" else y[0]
    kernels = ["onednn", "stock", "blocked"] + (["gemv"] if m.gemv is not None and rows <= gemv_kernel.MAX_ROWS else []) \
        + (["tiles"] if rows > TILE_ROWS else []) \
        + (["amx"] if m.gemv is not None and amx_kernel.takes(rows, m.in_features) else []) \
        + (["amx_gemm"] if m.takes("amx_gemm", rows) else [])
    for kernel in kernels:
        m.kernels = [kernel] * len(PROBE_ROWS)
        assert m.kernel_for(x) == kernel
        with torch.inference_mode():
            got = m.swiglu(x) if op == "swiglu" else m.add_to(res, x) if op == "add" else m(x)
        assert got.shape == want.shape
        assert (got.float() - want).abs().max() <= 0.02 * want.abs().max() + 0.02, kernel


@native_bf16
@pytest.mark.parametrize("down_kernel", ["same", "amx_gemm"])
@pytest.mark.parametrize("kernel", ["tiles", "blocked"])
@pytest.mark.parametrize("rows", [600, 1100])
def test_the_mlp_tile_by_tile_is_the_two_step_mlp(rows, kernel, down_kernel):
    """Where the gate/up product runs in tiles, the MLP runs tile by tile (each tile's SwiGLU straight into the down
    projection with its residual add): the model's own MLP to bf16 rounding, and the two-step tiled path's rows to
    that of one down projection; elsewhere it declines and the caller runs the two steps."""
    from ragkv.models.onednn import TILE_ROWS, OneDnnLinear

    torch.manual_seed(0)
    gate, up = (torch.nn.Linear(64, 160, bias=False).to(torch.bfloat16) for _ in range(2))
    down = torch.nn.Linear(160, 64, bias=False).to(torch.bfloat16)
    gate_up, down_copy = OneDnnLinear([gate, up]), OneDnnLinear(down)
    x = torch.randn(1, rows, 64, dtype=torch.bfloat16)
    res = torch.randn(1, rows, 64, dtype=torch.bfloat16)
    gate_up.kernels = down_copy.kernels = [kernel] * len(PROBE_ROWS)
    if down_kernel == "amx_gemm":  # the down projection on the many-row AMX kernel, its residual add inside
        if not down_copy.takes("amx_gemm", TILE_ROWS):
            pytest.skip("the AMX kernels are built only on CPUs with AMX-BF16")
        down_copy.kernels = ["amx_gemm"] * len(PROBE_ROWS)
    want = res.float() + torch.nn.functional.linear(
        torch.nn.functional.silu(torch.nn.functional.linear(x.float(), gate.weight.float()))
        * torch.nn.functional.linear(x.float(), up.weight.float()), down.weight.float())
    with torch.inference_mode():
        got = gate_up.mlp_add_to(down_copy, res, x)
        two_steps = down_copy.add_to(res, gate_up.swiglu(x))
        assert gate_up.mlp_add_to(down_copy, res, x[:, :TILE_ROWS]) is None  # one tile: the two steps
        gate_up.kernels = ["onednn"] * len(PROBE_ROWS)
        assert gate_up.mlp_add_to(down_copy, res, x) is None
    assert got.shape == want.shape
    assert (got.float() - want).abs().max() <= 0.02 * want.abs().max() + 0.02
    assert (got.float() - two_steps.float()).abs().max() <= 2 ** -6 * two_steps.float().abs().max()

@native_bf16
@pytest.mark.parametrize("kind", ["blocked", "amx_gemm"])
def test_a_kernels_own_copy_is_kept_only_where_a_row_class_runs_on_it(kind, tmp_path):
    """A kernel's own copy of a product (oneDNN's blocked copy; the AMX gemm's tile copy) is made when the chooser
    times it and kept only where the measurements chose it for some row class (a fake timer: that kernel fastest for
    the 17+ row classes of the 96-wide product only); the other products drop it and read the model's weights in
    place. Choices read from the cache make the copy for the products that chose it only (none is made before)."""
    from ragkv.models import onednn

    copy_of = (lambda m: m.blocked) if kind == "blocked" else (lambda m: m.tiles)  # noqa: E731

    torch.manual_seed(0)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wide = torch.nn.Linear(64, 96, bias=False).to(torch.bfloat16)
            self.narrow = torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16)

    copy_ = Tiny()
    copy_.wide, copy_.narrow = onednn.OneDnnLinear(copy_.wide), onednn.OneDnnLinear(copy_.narrow)
    assert copy_of(copy_.wide) is None and copy_of(copy_.narrow) is None  # made on first need
    if not (copy_.wide.takes(kind, 600) and copy_.narrow.takes(kind, 600)):
        pytest.skip(f"no {kind} kernel on this CPU")
    clock = FakeClock({})
    chooser = KernelChooser(tmp_path / "k.json", timer=clock)
    real_choose = chooser.choose

    def choose(product, dtype, macs, candidates, default, **kw):  # `kind`: 1 ms at 17+ rows of the wide one
        def cost(name, rows):
            return 1.0 if name == kind and rows > 16 and "->96" in product else 2.0 + len(name) / 100
        fake = {n: (lambda n, make: lambda rows: make(rows) and (lambda: setattr(
            clock, "now", clock.now + cost(n, rows) / 1000)))(n, make) for n, make in candidates.items()}
        return real_choose(product, dtype, macs, fake, default, **kw)
    chooser.choose = choose
    onednn.choose_kernels(copy_, chooser)
    assert copy_.wide.kernels[3:] == [kind] * 3 and kind not in copy_.narrow.kernels
    assert copy_of(copy_.wide) is not None and copy_of(copy_.narrow) is None
    assert not copy_.narrow.takes(kind, 600) and copy_.narrow.kernel_for_rows(600) != kind
    chooser.save()
    again = Tiny()
    again.wide, again.narrow = onednn.OneDnnLinear(again.wide), onednn.OneDnnLinear(again.narrow)
    onednn.choose_kernels(again, KernelChooser(tmp_path / "k.json", timer=lambda: pytest.fail("measured again")))
    assert copy_of(again.wide) is not None and copy_of(again.narrow) is None
    x = torch.randn(600, 64, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), again.wide.weight.float())
    assert again.wide.kernel_for_rows(600) == kind and (again.wide(x).float() - want).abs().max() < 0.05


@native_bf16
def test_the_gate_up_product_is_timed_with_its_down_projection(tiny_dirs, tmp_path):
    """The chooser times a gate/up product inside its MLP as MLP.add_to runs it: "tiles" tile by tile through the down
    projection (what the tiles save there counts), every other kernel then the down projection by its own choice;
    both give the MLP. A copy's table names the product "mlp", its down projections chosen first."""
    from conftest import _load_tiny

    from ragkv.models.onednn import OneDnnLinear, _probe
    from ragkv.models.quant import decode_copy

    torch.manual_seed(0)
    gate, up = (torch.nn.Linear(64, 160, bias=False).to(torch.bfloat16) for _ in range(2))
    down = torch.nn.Linear(160, 64, bias=False).to(torch.bfloat16)
    gate_up, down_copy = OneDnnLinear([gate, up]), OneDnnLinear(down)
    down_copy.kernels = ["onednn"] * len(PROBE_ROWS)
    tiled, calls = gate_up.mlp_add_to, []
    gate_up.mlp_add_to = lambda *a: calls.append(1) or tiled(*a)
    assert _probe(gate_up, "mlp", "tiles", down_copy)(300) is None  # one tile: not "tiles"
    torch.manual_seed(1)
    by_tiles = _probe(gate_up, "mlp", "tiles", down_copy)(600)()
    assert calls == [1]
    torch.manual_seed(1)  # the same random rows and residual
    whole = _probe(gate_up, "mlp", "onednn", down_copy)(600)()
    assert by_tiles.shape == whole.shape == (1, 600, 64)
    assert (by_tiles.float() - whole.float()).abs().max() <= 2 ** -6 * whole.float().abs().max()
    chooser = KernelChooser(tmp_path / "k.json")
    decode_copy(_load_tiny(tiny_dirs["qwen2"], torch.bfloat16).model, "onednn", chooser)
    products = [e["product"] for e in chooser.table.values()]
    assert any(p.startswith("mlp ") for p in products) and not any(p.startswith("swiglu ") for p in products)


@native_bf16
def test_a_bf16_onednn_copy_measures_its_products_once_per_machine(tiny_dirs, tmp_path):
    """Every product of a bf16 `onednn` copy gets a measured kernel per row class; a second copy reads the cache."""
    from conftest import _load_tiny

    from ragkv.models.onednn import _onednn_linears
    from ragkv.models.quant import decode_copy

    model = _load_tiny(tiny_dirs["qwen2"], torch.bfloat16).model
    chooser = KernelChooser(tmp_path / "k.json")
    copy_ = decode_copy(model, "onednn", chooser)
    linears = list(_onednn_linears(copy_))
    assert linears and all(m.kernels is not None and len(m.kernels) == len(PROBE_ROWS) for _, m in linears)
    assert {a for a, _ in linears} >= {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    assert chooser.measured == len({e["product"] for e in chooser.table.values()}) and (tmp_path / "k.json").exists()
    again = KernelChooser(tmp_path / "k.json", timer=lambda: pytest.fail("measured again"))
    decode_copy(model, "onednn", again)
    assert again.measured == 0


def test_prefill_attention_follows_its_measurement(tmp_path, monkeypatch):
    """The causal attention of a prefill takes whichever of ragkv's kernel (its AVX-512 BF16 path, its AMX path) and
    SDPA was measured fastest for its heads and row class (a fake timer here)."""
    from ragkv.ops import attention, prefill_kernel

    monkeypatch.setattr(attention, "_PREFILL_CHOICE", {})
    costs = {"kernel": lambda r: 1.0 if r <= 128 else 3.0, "amx": lambda r: 1.5 if r <= 128 else 1.0,
             "sdpa": lambda r: 2.0}
    clock = FakeClock(costs)
    ran = []
    monkeypatch.setattr(prefill_kernel, "applies", lambda q, k: q.shape[2] > 16)
    monkeypatch.setattr(prefill_kernel, "amx_applies", lambda q, k: q.shape[2] > 16)
    chooser = KernelChooser(tmp_path / "k.json", timer=clock)
    real_choose = chooser.choose

    def choose(product, dtype, macs, candidates, default):  # the real probes' calls, costed by the fake clock
        fake = {n: (lambda n, make: lambda rows: (make(rows) and clock.kernel(n, rows)))(n, make)
                for n, make in candidates.items()}
        return real_choose(product, dtype, macs, fake, default)
    monkeypatch.setattr(chooser, "choose", choose)
    choice = attention.choose_prefill_attention(chooser, torch.bfloat16, 4, 2, 64)
    assert choice == ["sdpa", "sdpa", "sdpa", "kernel", "amx", "amx"]  # the kernel cannot take <= 16 rows
    monkeypatch.setattr(prefill_kernel, "prefill_attention",
                        lambda q, k, v, past, amx: ran.append("amx" if amx else "kernel") or q)

    def attend(rows):
        q = torch.randn(1, 4, rows, 64, dtype=torch.bfloat16)
        return attention.causal_attention(q, *[torch.randn(1, 2, rows, 64, dtype=torch.bfloat16)] * 2, 0, None)
    attend(100)
    assert ran == ["kernel"]
    attend(300)
    assert ran == ["kernel", "amx"]
    assert attend(12).shape == (1, 4, 12, 64) and ran == ["kernel", "amx"]  # 12 rows: SDPA, as measured


@native_bf16
def test_the_prefill_kernel_and_sdpa_give_the_same_causal_attention():
    """Either choice of choose_prefill_attention computes fp32 SDPA's causal attention to bf16 rounding."""
    from ragkv.ops import prefill_kernel
    from ragkv.ops.attention import sdpa

    torch.manual_seed(0)
    q = torch.randn(1, 14, 300, 64, dtype=torch.bfloat16)
    k, v = torch.randn(2, 1, 2, 300, 64, dtype=torch.bfloat16)
    want = sdpa(q.float(), k.float(), v.float(), causal=True)
    got_sdpa = sdpa(q, k, v, causal=True).float()
    assert (got_sdpa - want).abs().max() < 0.02
    if prefill_kernel.kernel() is not None:
        assert (prefill_kernel.prefill_attention(q, k, v, past=0).float() - want).abs().max() < 0.02
    if prefill_kernel.amx_applies(q, k):
        assert (prefill_kernel.prefill_attention(q, k, v, past=0, amx=True).float() - want).abs().max() < 0.02


@pytest.mark.skipif(amx_kernel.kernel() is None, reason="the AMX kernel is built only on CPUs with AMX-BF16")
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 50, 128])
@pytest.mark.parametrize("shape", [(100, 64), (1152, 896), (896, 4864)])
def test_the_amx_kernel_computes_the_linear_with_its_bias(rows, shape):
    """Over gemv's packed copy, at every row count it takes (groups of 16 and a short last one) and an output count
    that is not a multiple of 64: fp32 F.linear's result, bias included, to bf16 rounding."""
    torch.manual_seed(rows)
    N, K = shape
    w, b = torch.randn(N, K, dtype=torch.bfloat16) / 30, torch.randn(N)
    x = torch.randn(1, rows, K, dtype=torch.bfloat16)
    packed, _, bias = gemv_kernel.pack(w, b)
    got = amx_kernel.product(x, packed, bias, N)
    want = torch.nn.functional.linear(x.float(), w.float(), b)
    assert got.shape == (1, rows, N) and got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() <= 0.01 * want.abs().max() + 0.01
    last = torch.cat([x, x], dim=1)[:, -1:]  # one row viewed out of a longer prompt (a decode row's stride)
    assert torch.equal(amx_kernel.product(last, packed, bias, N), amx_kernel.product(x[:, -1:].clone(), packed,
                                                                                     bias, N))


@pytest.mark.skipif(amx_kernel.kernel() is None, reason="the AMX kernel is built only on CPUs with AMX-BF16")
@pytest.mark.parametrize("rows", [17, 32, 50, 600])
@pytest.mark.parametrize("shape", [(100, 64), (1152, 896), (896, 4864), (1280, 256), (4160, 256)])
def test_the_amx_gemm_computes_the_linear_with_its_op(rows, shape):
    """The many-row AMX kernel over its tile copy, at row counts that fill 32-row blocks or leave a short last one,
    K over one or several of its 256-k chunks, output counts that are not a multiple of its 32-wide pieces, and a
    weight whose share per thread outgrows 1 MB (row blocks then pass it in groups of up to 16, not 4): fp32
    F.linear's result with its bias, with a residual added, and over a paired copy of a joined gate/up (gate first)
    the plain product and silu(gate) * up, each to bf16 rounding."""
    torch.manual_seed(rows)
    N, K = shape
    w, b = torch.randn(N, K, dtype=torch.bfloat16) / 30, torch.randn(N)
    x = torch.randn(1, rows, K, dtype=torch.bfloat16)
    res = torch.randn(1, rows, N, dtype=torch.bfloat16)
    tiles, bias = amx_kernel.pack_tiles(w, b)
    want = torch.nn.functional.linear(x.float(), w.float(), b)
    close = lambda got, expect: (got.float() - expect).abs().max() <= 0.01 * expect.abs().max() + 0.01  # noqa: E731
    for got, expect in ((amx_kernel.gemm(x, tiles, bias, N), want),
                        (amx_kernel.gemm(x, tiles, bias, N, residual=res), want + res.float())):
        assert got.shape == (1, rows, N) and got.dtype == torch.bfloat16 and close(got, expect)
    if N % 32 == 0:
        tiles, bias = amx_kernel.pack_tiles(w, b, paired=True)
        swiglu = amx_kernel.gemm(x, tiles, bias, N // 2, swiglu=True)
        assert swiglu.shape == (1, rows, N // 2)
        assert close(swiglu, torch.nn.functional.silu(want[..., :N // 2]) * want[..., N // 2:])
        assert close(amx_kernel.gemm(x, tiles, bias, N, paired=True), want)


def test_decode_attention_takes_the_path_measured_faster_for_every_batch(tmp_path):
    """The bf16 decode kernel's path (AVX-512 BF16 or AMX) is the one measured faster on one probe step (a fake
    timer here), and it then serves every batch size alike; where the AMX path is not built, AVX-512 unmeasured."""
    from ragkv.ops import attention, decode_kernel

    mod = decode_kernel.kernel()
    if mod is None or not mod.amx_built():
        chooser = KernelChooser(tmp_path / "k.json", timer=lambda: pytest.fail("nothing to measure"))
        assert attention.choose_decode_attention(chooser, torch.bfloat16, 4, 2, 64) == "avx512"
        return
    before = mod.amx_in_use()
    try:
        for amx_ms, want in ((1.0, "amx"), (3.0, "avx512")):
            clock = FakeClock({"avx512": lambda r: 2.0, "amx": lambda r: amx_ms})
            chooser = KernelChooser(tmp_path / f"{want}.json", timer=clock)
            real_choose = chooser.choose

            def choose(product, dtype, macs, candidates, default):  # the real probes, costed by the fake clock
                fake = {n: (lambda n, make: lambda rows: (make(rows) and clock.kernel(n, rows)))(n, make)
                        for n, make in candidates.items()}
                return real_choose(product, dtype, macs, fake, default)
            chooser.choose = choose
            assert attention.choose_decode_attention(chooser, torch.bfloat16, 4, 2, 64) == want
            assert mod.amx_in_use() is (want == "amx")
            entry, = chooser.table.values()
            assert [bool(ms) for ms in entry["ms"]] == [r == attention.DECODE_PROBE_SEQUENCES for r in PROBE_ROWS]
    finally:
        mod.use_amx(before)


@pytest.mark.parametrize("forced", ["avx512", "amx"])
def test_the_decode_attention_path_can_be_fixed_unmeasured(tmp_path, monkeypatch, forced):
    """RAGKV_DECODE_ATTENTION=avx512 or amx fixes the bf16 kernel's path (A/B runs) without measuring."""
    from ragkv.ops import attention, decode_kernel

    mod = decode_kernel.kernel()
    if mod is None or not mod.amx_built():
        pytest.skip("one path only: the AMX one is built only on CPUs with AMX-BF16")
    before = mod.amx_in_use()
    monkeypatch.setenv("RAGKV_DECODE_ATTENTION", forced)
    try:
        chooser = KernelChooser(tmp_path / "k.json", timer=lambda: pytest.fail("measured"))
        assert attention.choose_decode_attention(chooser, torch.bfloat16, 14, 2, 64) == forced
        assert mod.amx_in_use() is (forced == "amx") and chooser.measured == 0
    finally:
        mod.use_amx(before)
