"""Fused optimizer: bitwise parity with the unfused step, state dicts, edge cases, GradScaler, with_bagua.

Every parity check compares a fused optimizer against an identical unfused one fed the same gradients, with
``torch.equal`` (exact): an elementwise step computes the same numbers on a concatenation as on the pieces.
"""

from __future__ import annotations

import contextlib
import copy
import io
import warnings

import pytest
import torch

from bagua.torch_api.contrib import fuse_optimizer, is_fused_optimizer
from bagua.torch_api.contrib.fuse.layout import mutual_runs

SHAPES = [(7, 13), (33,), (5, 5, 3), (100, 3), (129,), (16, 16), (3,)]
STEPS = 4


class Lion(torch.optim.Optimizer):
    """A user-written optimizer with a per-parameter Python loop (Chen et al. 2023, arXiv 2302.06675)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["count"] = 0  # a Python scalar state, as user code often keeps
                m = state["exp_avg"]
                state["count"] += 1
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(m.mul(b1).add_(p.grad, alpha=1 - b1).sign_(), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)
        return loss


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
    "rmsprop_centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, centered=True, momentum=0.9),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, lr_decay=0.01, initial_accumulator_value=0.1),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2, weight_decay=0.01),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "nadam_decoupled": lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=1),
    "lion": lambda ps: Lion(ps, lr=1e-2, weight_decay=0.1),
}


def make_params(seed=0, shapes=SHAPES, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype)) for s in shapes]


def grads_for(params, step, seed=100):
    gen = torch.Generator().manual_seed(seed + step)
    return [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) for p in params]


def step_together(ref, ref_params, others, steps, fresh_ref=False):
    """Step ``ref`` and every ``(optimizer, params)`` of ``others`` on the same gradients (``fuse_step`` for fused
    optimizers), once per step number in ``steps``; ``fresh_ref`` gives ``ref`` new gradient tensors each step."""
    for step in steps:
        grads = grads_for(ref_params, step)
        set_grads(ref_params, grads, keep=not fresh_ref)
        for _, ps in others:
            set_grads(ps, grads)
        ref.step()
        for opt, _ in others:
            (opt.fuse_step if is_fused_optimizer(opt) else opt.step)()


def set_grads(params, grads, keep=True):
    """Write ``grads``; with ``keep`` an existing ``.grad`` is filled in place (``zero_grad(set_to_none=False)``)."""
    for p, g in zip(params, grads):
        if g is None:
            p.grad = None
        elif keep and p.grad is not None:
            p.grad.copy_(g)
        else:
            p.grad = g.clone()


def assert_same(ref_opt, fused_opt, ref_params, fused_params):
    for a, b in zip(ref_params, fused_params):
        assert torch.equal(a, b), "parameters differ"
        sa, sb = ref_opt.state.get(a, {}), fused_opt.state.get(b, {})
        assert sa.keys() == sb.keys()
        for key in sa:
            if isinstance(sa[key], torch.Tensor):
                assert torch.equal(sa[key], sb[key]), f"state {key!r} differs"
            else:
                assert sa[key] == sb[key], f"state {key!r} differs"


def run_pair(make, steps=STEPS, keep=True, grad_mask=None, **fuse_kwargs):
    ref_params, fused_params = make_params(), make_params()
    ref = make(ref_params)
    fused = fuse_optimizer(make(fused_params), **fuse_kwargs)
    for step in range(steps):
        grads = grads_for(ref_params, step)
        if grad_mask is not None:
            grads = [g if grad_mask(step, i) else None for i, g in enumerate(grads)]
        set_grads(ref_params, grads, keep=False)
        set_grads(fused_params, grads, keep=keep)
        ref.step()
        fused.fuse_step()
    assert_same(ref, fused, ref_params, fused_params)
    return ref, fused, ref_params, fused_params


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_bitwise_parity(name):
    _, fused, _, fused_params = run_pair(OPTIMIZERS[name], chunk_bytes=256)  # small chunks: many per run
    assert fused._bagua_fused_count == STEPS
    flat = fused._bagua_fuser.layouts[0].segments[0].flat_param
    assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in fused_params)


@pytest.mark.parametrize("name", ["adam", "sgd_momentum", "lion", "rprop"])
def test_parity_default_chunks_and_no_checks(name):
    run_pair(OPTIMIZERS[name], check_flatten=False)


@pytest.mark.parametrize("name", ["adam", "lion"])
def test_gradients_replaced_every_step(name):
    """``zero_grad()`` (set_to_none=True) + backward gives new gradient tensors: they are copied in, silently."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_pair(OPTIMIZERS[name], keep=False)


# shapes whose gradients are copied in by torch.cat per range of equal sizes after the first dimension, and by
# one foreach copy for the other parameters (layout.copy_ranges)
RANGE_SHAPES = [(4, 5), (3, 5), (2, 5), (7,), (9,), (3, 2, 2), (6, 3), (5, 4), (5, 4), (5, 4), (11,)]


def test_copy_ranges_cut_by_sizes_after_the_first_dimension():
    params = make_params(shapes=RANGE_SHAPES)
    seg = fuse_optimizer(torch.optim.SGD(params, lr=0.1))._bagua_fuser.layouts[0].segments[0]
    assert [(i, j, out is not None) for i, j, out in seg.copy_ranges] == [
        (0, 3, True), (3, 5, True), (5, 7, False), (7, 10, True), (10, 11, False)]
    for i, j, out in seg.copy_ranges:
        if out is not None:
            assert out.data_ptr() == seg.grad_views[i].data_ptr() and out.shape[1:] == params[i].shape[1:]
            assert out.numel() == seg.offsets[j] - seg.offsets[i]


def _fresh_grads(values, backwards):
    """New gradient tensors with ``values``, as views of one new buffer, at increasing addresses in parameter order
    or (``backwards``) in reverse, as backward's allocations often are: both copy orders of copy_grads run."""
    sizes = [v.numel() for v in values]
    buf = torch.empty(sum(sizes), dtype=values[0].dtype)
    starts, at = [], 0
    for n in reversed(sizes) if backwards else sizes:
        starts.append(at)
        at += n
    if backwards:
        starts.reverse()
    out = [buf[a : a + v.numel()].view(v.shape) for a, v in zip(starts, values)]
    for o, v in zip(out, values):
        o.copy_(v)
    return out


@pytest.mark.parametrize("name", ["adam", "lion", "sgd_momentum"])
@pytest.mark.parametrize("backwards", [False, True])
@pytest.mark.parametrize("some_none", [False, True])
def test_fresh_gradients_copied_by_ranges_match_unfused(name, backwards, some_none):
    """New gradient tensors every step (the default ``zero_grad()``), at increasing or decreasing addresses, with or
    without parameters that have no gradient at some steps: bitwise equal to the unfused step, and the flat
    gradient holds this step's gradients."""
    ref_params, fused_params = make_params(shapes=RANGE_SHAPES), make_params(shapes=RANGE_SHAPES)
    ref, fused = OPTIMIZERS[name](ref_params), fuse_optimizer(OPTIMIZERS[name](fused_params), chunk_bytes=64)
    seg = fused._bagua_fuser.layouts[0].segments[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(5):
            grads = grads_for(ref_params, step)
            fresh = _fresh_grads(grads, backwards)
            assert (fresh[0].data_ptr() > fresh[-1].data_ptr()) == backwards
            for i, (rp, fp) in enumerate(zip(ref_params, fused_params)):
                none = some_none and (i + step) % 4 == 0
                rp.grad, fp.grad = (None, None) if none else (grads[i].clone(), fresh[i])
            ref.step()
            fused.fuse_step()
            assert all(fp.grad is None or torch.equal(fp.grad, v)
                       for fp, v in zip(fused_params, seg.grad_views))
    assert_same(ref, fused, ref_params, fused_params)


def _zero_grad_model(seed: int = 0):
    """A model with a frozen layer and a layer used only at some steps (its gradient stays None there)."""
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict({
        "a": torch.nn.Linear(6, 8), "frozen": torch.nn.Linear(8, 8), "b": torch.nn.Linear(8, 3),
        "sometimes": torch.nn.Linear(6, 3),
    })
    model["frozen"].requires_grad_(False)
    return model


def _zero_grad_loss(model, step: int, micro: int):
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(10 * step + micro))
    out = model["b"](model["frozen"](torch.tanh(model["a"](x))))
    if step % 3 == 1:
        out = out + model["sometimes"](x)
    return out.pow(2).mean()


ZERO_GRAD_MODES = {
    "none": lambda step: True,  # zero_grad() as by default
    "zeros": lambda step: False,  # zero_grad(set_to_none=False)
    "alternate": lambda step: step % 2 == 0,
}


@pytest.mark.parametrize("name", ["adam", "lion", "sgd_momentum"])
@pytest.mark.parametrize("mode", sorted(ZERO_GRAD_MODES))
@pytest.mark.parametrize("accumulate", [1, 3])
def test_zero_grad_modes_and_accumulation_match_unfused(name, mode, accumulate):
    """Real backward passes under each ``zero_grad`` mode, ``accumulate`` backwards per step, frozen and sometimes
    unused parameters: the fused weights and state equal the unfused ones bitwise; gradients kept across steps end
    up as views of the flat gradient (fresh ones may too, when a new tensor reuses a freed one's ``id``)."""
    ref_model, fused_model = _zero_grad_model(), _zero_grad_model()
    ref = OPTIMIZERS[name](list(ref_model.parameters()))
    fused = fuse_optimizer(OPTIMIZERS[name](list(fused_model.parameters())))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(6):
            for model, opt in ((ref_model, ref), (fused_model, fused)):
                opt.zero_grad(set_to_none=ZERO_GRAD_MODES[mode](step))
                for micro in range(accumulate):
                    _zero_grad_loss(model, step, micro).backward()
                (opt.fuse_step if opt is fused else opt.step)()
    assert_same(ref, fused, list(ref_model.parameters()), list(fused_model.parameters()))
    assert all(p.grad is None for p in fused_model["frozen"].parameters())
    seg = fused._bagua_fuser.layouts[0].segments[0]
    if not ZERO_GRAD_MODES[mode](5):
        assert all(p.grad is v for p, v in zip(seg.params, seg.grad_views) if p.grad is not None)


@pytest.mark.parametrize("name", ["adam", "sgd_momentum", "lion", "adagrad"])
def test_gradients_none_and_frozen(name):
    # parameter 1 never has a gradient (frozen), parameter 3 skips odd steps: its scalar state falls behind
    mask = lambda step, i: i != 1 and not (i == 3 and step % 2)  # noqa: E731
    _, fused, _, params = run_pair(OPTIMIZERS[name], steps=5, grad_mask=mask)
    assert fused.state.get(params[1], {}).get("step", 0) == 0  # never stepped


def test_mixed_dtypes_make_one_segment_each():
    shapes = SHAPES
    ref_params, fused_params = make_params(shapes=shapes), make_params(shapes=shapes)
    for ps in (ref_params, fused_params):
        for i in (1, 4):
            ps[i].data = ps[i].data.to(torch.float64)
        ps[5].data = ps[5].data.to(torch.bfloat16)
    ref = torch.optim.Adam(ref_params, lr=1e-2)
    fused = fuse_optimizer(torch.optim.Adam(fused_params, lr=1e-2))
    assert len(fused._bagua_fuser.layouts[0].segments) == 3
    step_together(ref, ref_params, [(fused, fused_params)], range(STEPS), fresh_ref=True)
    assert_same(ref, fused, ref_params, fused_params)


def test_state_dict_round_trip():
    ref, fused, ref_params, fused_params = run_pair(OPTIMIZERS["adam"])
    buf = io.BytesIO()
    torch.save(fused.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf)
    # the fused state loads into a plain optimizer, and a plain state dict into a fused one
    plain_params, refused_params = make_params(), make_params()
    for dst, src in ((plain_params, fused_params), (refused_params, fused_params)):
        with torch.no_grad():
            for d, s in zip(dst, src):
                d.copy_(s)
    plain = OPTIMIZERS["adam"](plain_params)
    plain.load_state_dict(loaded)
    refused = fuse_optimizer(OPTIMIZERS["adam"](refused_params))
    with pytest.warns(UserWarning, match="copied into the flat state"):
        refused.load_state_dict(copy.deepcopy(ref.state_dict()))
        step_together(ref, ref_params, [(plain, plain_params), (refused, refused_params), (fused, fused_params)],
                      range(STEPS, STEPS + 2))
    assert_same(ref, plain, ref_params, plain_params)
    assert_same(ref, refused, ref_params, refused_params)
    assert_same(ref, fused, ref_params, fused_params)
    seg = refused._bagua_fuser.layouts[0].segments[0]
    assert all(refused.state[p]["exp_avg"].data_ptr() == seg.view(seg.flat_state["exp_avg"], i).data_ptr()
               for i, p in enumerate(seg.params))


# -- large segments: huge-page flat buffers, automatic chunk sizes -------------------------------------------------

LARGE_SHAPES = [(512, 1024), (1000,), (512, 1024), (33, 7)]  # 4.2 MiB of float32: huge pages, several chunks


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def test_flat_buffer_huge_pages(monkeypatch):
    from bagua.torch_api.contrib.fuse import layout

    if not layout.huge_pages_enabled():
        pytest.skip("transparent huge pages are not available here")
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        n = layout.HUGE_PAGES_MIN_BYTES // torch.empty((), dtype=dtype).element_size() + 3
        buf = layout.flat_buffer(n, dtype, cpu, zero=False)
        assert buf.shape == (n,) and buf.dtype == dtype and buf.is_contiguous()
        assert buf.data_ptr() % (2 << 20) == 0 and not buf.untyped_storage().resizable()
        assert torch.count_nonzero(buf) == 0  # fresh anonymous memory reads as zeros
        view = buf[5:9]
        address = buf.data_ptr()
        del buf
        view.fill_(2)  # a view keeps the mapping alive
        assert view.sum() == 8 and _mapped(address)
        del view
        assert not _mapped(address)  # unmapped with the last tensor
    assert layout.flat_buffer(10, torch.float32, cpu).untyped_storage().resizable()  # small: ordinary
    monkeypatch.setenv("BAGUA_FUSE_HUGE_PAGES", "0")
    assert not layout.huge_pages_enabled()
    assert layout.flat_buffer(n, torch.float64, cpu).untyped_storage().resizable()


@pytest.mark.parametrize("huge_pages", ["1", "0"])
@pytest.mark.parametrize("name,chunk_kib", [("sgd_momentum", 1536), ("adam", 1024), ("lion", 1536)])
def test_large_segment_automatic_chunks_and_state_dict(monkeypatch, name, chunk_kib, huge_pages):
    """Several automatic-size chunks per run, sized for the state the first step made; bitwise equal to step(),
    also after a state dict round trip into a plain and into a fused optimizer."""
    from bagua.torch_api.contrib.fuse import layout

    monkeypatch.setenv("BAGUA_FUSE_HUGE_PAGES", huge_pages)
    make = OPTIMIZERS[name]
    ref_params, fused_params = make_params(shapes=LARGE_SHAPES), make_params(shapes=LARGE_SHAPES)
    ref, fused = make(ref_params), fuse_optimizer(make(fused_params))
    step_together(ref, ref_params, [(fused, fused_params)], range(3), fresh_ref=True)
    assert_same(ref, fused, ref_params, fused_params)
    fuser = fused._bagua_fuser
    seg = fuser.layouts[0].segments[0]
    (run,), _ = fuser.plan[0]
    assert run.sized_for == len(seg.flat_state) and len(run.chunks) > 1
    assert run.chunks[0].numel() * 4 == chunk_kib * 1024
    on_huge_pages = huge_pages == "1" and layout.huge_pages_enabled()
    for flat in (seg.flat_param, seg.flat_grad, *seg.flat_state.values()):
        assert (flat.data_ptr() % (2 << 20) == 0 and not flat.untyped_storage().resizable()) == on_huge_pages

    buf = io.BytesIO()
    torch.save(fused.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf)
    plain_params, refused_params = make_params(shapes=LARGE_SHAPES), make_params(shapes=LARGE_SHAPES)
    with torch.no_grad():
        for d1, d2, src in zip(plain_params, refused_params, fused_params):
            d1.copy_(src)
            d2.copy_(src)
    plain, refused = make(plain_params), fuse_optimizer(make(refused_params))
    plain.load_state_dict(loaded)
    refused.load_state_dict(copy.deepcopy(fused.state_dict()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step_together(ref, ref_params, [(plain, plain_params), (refused, refused_params), (fused, fused_params)],
                      range(3, 5))
    assert any("copied into the flat state" in str(w.message) for w in caught)
    for opt, ps in ((plain, plain_params), (refused, refused_params), (fused, fused_params)):
        assert_same(ref, opt, ref_params, ps)


def test_cpu_chunk_bytes_rule():
    from bagua.torch_api.contrib.fuse import plan

    sizes = [plan.cpu_chunk_bytes(k) for k in range(20)]
    assert sizes[0] == 3 << 20 and sizes[1] == 1536 << 10 and sizes[2] == 1 << 20 and sizes[-1] == plan.CPU_CHUNK_MIN
    assert sizes == sorted(sizes, reverse=True) and all(s % 4096 == 0 for s in sizes)


@pytest.mark.parametrize("name", ["adam", "sgd_momentum", "lion"])
def test_plain_step_in_between(name):
    """A plain ``step()`` (even the first one, creating state outside the flat buffers) mixes with fuse_step."""
    ref_params, fused_params = make_params(), make_params()
    ref = OPTIMIZERS[name](ref_params)
    fused = fuse_optimizer(OPTIMIZERS[name](fused_params))
    for step in range(5):
        grads = grads_for(ref_params, step)
        set_grads(ref_params, grads, keep=False)
        set_grads(fused_params, grads)
        ref.step()
        fused.step() if step in (0, 2) else fused.fuse_step()
    assert_same(ref, fused, ref_params, fused_params)


def test_direct_state_edit_then_reload():
    """A state tensor assigned by hand is taken in after ``load_state_dict(state_dict())``."""
    ref, fused, ref_params, fused_params = run_pair(OPTIMIZERS["adam"])
    for opt, ps in ((ref, ref_params), (fused, fused_params)):
        opt.state[ps[2]]["exp_avg"] = torch.full_like(ps[2], 0.5)
    fused.load_state_dict(fused.state_dict())
    for step in range(STEPS, STEPS + 2):
        grads = grads_for(ref_params, step)
        set_grads(ref_params, grads)
        set_grads(fused_params, grads)
        ref.step()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fused.fuse_step()
    assert_same(ref, fused, ref_params, fused_params)


def test_add_param_group_after_fusing():
    ref_params, fused_params = make_params(), make_params()
    ref = OPTIMIZERS["adam"](ref_params[:4])
    fused = fuse_optimizer(OPTIMIZERS["adam"](fused_params[:4]))
    for step in range(4):
        if step == 2:
            ref.add_param_group({"params": ref_params[4:], "lr": 0.05})
            fused.add_param_group({"params": fused_params[4:], "lr": 0.05})
        n = 4 if step < 2 else len(SHAPES)
        grads = grads_for(ref_params[:n], step)
        set_grads(ref_params[:n], grads, keep=False)
        set_grads(fused_params[:n], grads)
        ref.step()
        if step == 2:
            with pytest.warns(UserWarning, match="param group 1 was added"):
                fused.fuse_step()
        else:
            fused.fuse_step()
    assert_same(ref, fused, ref_params, fused_params)
    assert len(fused._bagua_fuser.layouts[1].segments) == 1


def test_moved_parameter_is_copied_back():
    ref_params, fused_params = make_params(), make_params()
    ref, fused = OPTIMIZERS["sgd_momentum"](ref_params), fuse_optimizer(OPTIMIZERS["sgd_momentum"](fused_params))
    for step in range(3):
        if step == 1:
            for ps in (ref_params, fused_params):
                ps[2].data = ps[2].data * 0.5  # a new tensor: leaves the flat buffer
        grads = grads_for(ref_params, step)
        set_grads(ref_params, grads, keep=False)
        set_grads(fused_params, grads)
        ref.step()
        if step == 1:
            with pytest.warns(UserWarning, match="left the flat buffer"):
                fused.fuse_step()
        else:
            fused.fuse_step()
    assert_same(ref, fused, ref_params, fused_params)
    seg = fused._bagua_fuser.layouts[0].segments[0]
    assert fused_params[2].data_ptr() == seg.view(seg.flat_param, 2).data_ptr()


def test_do_flatten_false_fuses_what_is_contiguous():
    def params_in(buf_params):
        return [torch.nn.Parameter(t) for t in buf_params]

    def make():
        flat = torch.cat([p.detach().reshape(-1) for p in make_params()])
        views, offset = [], 0
        for s in SHAPES:
            n = torch.Size(s).numel()
            views.append(flat[offset : offset + n].view(s))
            offset += n
        ps = [torch.nn.Parameter(v) for v in views]  # shares ``flat``'s storage
        grad_flat = torch.zeros(offset)
        offset = 0
        for p in ps:
            p.grad = grad_flat[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
        return ps

    ref_params, fused_params = make_params(), make()
    ref = OPTIMIZERS["sgd_momentum"](ref_params)
    fused = fuse_optimizer(OPTIMIZERS["sgd_momentum"](fused_params), do_flatten=False)
    before = fused_params[0].data_ptr()
    step_together(ref, ref_params, [(fused, fused_params)], range(STEPS), fresh_ref=True)
    assert_same(ref, fused, ref_params, fused_params)
    assert fused_params[0].data_ptr() == before  # nothing was moved
    segs = fused._bagua_fuser.layouts[0].segments
    assert [len(s.params) for s in segs] == [len(SHAPES)] and fused._bagua_fused_count == STEPS


def test_fused_count_is_one_per_fused_param_group_per_step():
    """The original's ``_bagua_fused_count``: +1 for every param group a ``fuse_step`` fused, none for ``step()``."""
    ref_params, fused_params = make_params(), make_params()
    groups = lambda ps: [{"params": ps[:3]}, {"params": ps[3:6], "weight_decay": 0.1}, {"params": ps[6:]}]
    ref = torch.optim.Adam(groups(ref_params), lr=1e-2)
    fused = fuse_optimizer(torch.optim.Adam(groups(fused_params), lr=1e-2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # state made by the plain step() is copied into the flat buffers
        for step in range(STEPS):
            grads = grads_for(ref_params, step)
            set_grads(ref_params, grads, keep=False)
            set_grads(fused_params, grads)
            ref.step()
            fused.fuse_step() if step % 2 == 0 else fused.step()
    assert_same(ref, fused, ref_params, fused_params)
    # the last group holds one parameter: nothing to fuse there
    assert fused._bagua_fused_count == 2 * len(range(0, STEPS, 2))


def test_memory_flattened_by_another_owner_is_left_there():
    """Parameters and gradients re-pointed into someone else's flat buffer (as Bagua's buckets do, last parameter
    first) are not copied back: the step fuses what is contiguous there (nothing) and equals the unfused one."""
    ref_params, fused_params = make_params(), make_params()
    ref, fused = OPTIMIZERS["adam"](ref_params), fuse_optimizer(OPTIMIZERS["adam"](fused_params))
    step_together(ref, ref_params, [(fused, fused_params)], range(2), fresh_ref=True)
    assert fused._bagua_fused_count == 2
    total = sum(p.numel() for p in fused_params)
    weights, grads = torch.zeros(total), torch.zeros(total)
    offset = 0
    for p in reversed(fused_params):  # the other owner's layout
        n = p.numel()
        with torch.no_grad():
            weights[offset : offset + n].copy_(p.reshape(-1))
            p.data = weights[offset : offset + n].view(p.shape)
        p.grad = grads[offset : offset + n].view(p.shape)
        offset += n
    with pytest.warns(UserWarning, match="another flat buffer"):
        step_together(ref, ref_params, [(fused, fused_params)], range(2, 2 + STEPS), fresh_ref=True)
    assert_same(ref, fused, ref_params, fused_params)
    storages = {t.untyped_storage().data_ptr() for t in (weights, grads)}
    assert all(p.untyped_storage().data_ptr() in storages for p in fused_params)
    assert all(p.grad.untyped_storage().data_ptr() in storages for p in fused_params)
    assert fused._bagua_fused_count == 2


def test_do_flatten_false_on_separate_tensors_matches():
    _, fused, _, _ = run_pair(OPTIMIZERS["adam"], do_flatten=False)
    assert fused._bagua_fused_count == 0


def test_model_backward_closure_and_hooks():
    """Real autograd accumulates into the flat gradient views; the closure and step hooks behave as in step()."""
    torch.manual_seed(0)
    ref_model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    fused_model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    fused_model.load_state_dict(ref_model.state_dict())
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    fused = fuse_optimizer(torch.optim.AdamW(fused_model.parameters(), lr=1e-2))
    seen = []
    fused.register_step_post_hook(lambda opt, args, kwargs: seen.append(opt))
    data = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    for step in range(STEPS):
        for model, opt in ((ref_model, ref), (fused_model, fused)):
            def closure(model=model, opt=opt):
                opt.zero_grad(set_to_none=False)
                loss = model(data * (step + 1)).pow(2).mean()
                loss.backward()
                return loss

            loss = opt.step(closure) if opt is ref else opt.fuse_step(closure)
            assert loss is not None
    assert seen == [fused] * STEPS
    for a, b in zip(ref_model.parameters(), fused_model.parameters()):
        assert torch.equal(a, b)
    grad_flat = fused._bagua_fuser.layouts[0].segments[0].flat_grad
    assert all(p.grad.untyped_storage().data_ptr() == grad_flat.untyped_storage().data_ptr()
               for p in fused_model.parameters())


@pytest.mark.parametrize("amp_dtype", [torch.bfloat16, torch.float16])
def test_grad_scaler_with_replace_step(amp_dtype):
    """``scaler.step(optimizer)`` calls ``optimizer.step``: with ``replace_step=True`` that is the fused step.

    Step 2 feeds an infinite input, so its gradients are not finite and GradScaler skips that step.
    """
    torch.manual_seed(0)
    ref_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fused_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fused_model.load_state_dict(ref_model.state_dict())
    ref = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    fused = fuse_optimizer(torch.optim.Adam(fused_model.parameters(), lr=1e-2), replace_step=True)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) for _ in range(2)]
    data = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    skipped = 0
    for step in range(6):
        x = data * float("inf") if step == 2 else data
        for model, opt, scaler in ((ref_model, ref, scalers[0]), (fused_model, fused, scalers[1])):
            opt.zero_grad(set_to_none=False)
            with torch.autocast("cpu", dtype=amp_dtype):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += opt is fused and scaler.get_scale() < before
    assert skipped == 1 and scalers[0].get_scale() == scalers[1].get_scale()
    assert fused._bagua_fused_count == 5
    for a, b in zip(ref_model.parameters(), fused_model.parameters()):
        assert torch.equal(a, b)
    assert_same(ref, fused, list(ref_model.parameters()), list(fused_model.parameters()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["sgd_momentum", "adam", "lion"])
def test_half_precision_parameters(dtype, name):
    """bf16/fp16 parameters: equal up to one rounding at the elements where CPU kernels leave vector code.

    PyTorch's CPU kernels compute the last ``numel % 2V`` elements of a tensor (and of each thread's share) with
    scalar code that rounds ``a + alpha * b`` differently from the vector code in half precision. A flat tensor
    moves those elements into vector code, so they may differ by one rounding; the unfused ``step()`` itself
    changes the same way between 1 and 2 threads. Everywhere else the results are exact.
    """
    if name == "adam" and dtype == torch.float16:
        pytest.skip("fp16 Adam with eps=1e-8 divides 0 by 0 (eps underflows), fused or not")
    ref_params, fused_params = make_params(dtype=dtype), make_params(dtype=dtype)
    ref, fused = OPTIMIZERS[name](ref_params), fuse_optimizer(OPTIMIZERS[name](fused_params))
    step_together(ref, ref_params, [(fused, fused_params)], range(STEPS), fresh_ref=True)
    exact = total = 0
    for a, b in zip(ref_params, fused_params):
        tol = dict(rtol=4 * torch.finfo(dtype).eps, atol=4 * torch.finfo(dtype).eps)
        torch.testing.assert_close(b, a, **tol)
        exact += int((a == b).sum())
        total += a.numel()
    assert exact >= 0.9 * total


class PerTensorNorm(torch.optim.Optimizer):
    """Not elementwise: keeps a norm per parameter (LARS-like), state of shape (1,)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["norm"] = p.grad.norm().reshape(1)
                    p.sub_(p.grad / (self.state[p]["norm"] + 1), alpha=group["lr"])


def test_non_elementwise_state_falls_back_to_plain_step():
    ref_params, fused_params = make_params(), make_params()
    ref, fused = PerTensorNorm(ref_params), fuse_optimizer(PerTensorNorm(fused_params))
    with pytest.warns(UserWarning, match="not elementwise"):
        step_together(ref, ref_params, [(fused, fused_params)], range(3), fresh_ref=True)
    assert fused._bagua_fuser.fallback
    # later steps are plain, so from the same point both agree
    with torch.no_grad():
        for a, b in zip(ref_params, fused_params):
            b.copy_(a)
    set_grads(ref_params, grads_for(ref_params, 9), keep=False)
    set_grads(fused_params, grads_for(ref_params, 9))
    ref.step()
    fused.fuse_step()
    assert all(torch.equal(a, b) for a, b in zip(ref_params, fused_params))


@pytest.mark.parametrize("name", ["adam", "sgd", "lion"])
def test_odd_parameters_are_stepped_as_themselves(name):
    """A zero-dim parameter, a non-contiguous one and one with a sparse gradient stay out of the flat buffers."""

    def make(seed):
        ps = make_params(seed)
        gen = torch.Generator().manual_seed(seed + 1)
        ps.append(torch.nn.Parameter(torch.randn((), generator=gen)))  # zero-dim
        ps.append(torch.nn.Parameter(torch.randn(6, 4, generator=gen).t()))  # non-contiguous
        ps.append(torch.nn.Parameter(torch.randn(10, 3, generator=gen)))  # gets a sparse gradient (SGD only)
        return ps

    ref_params, fused_params = make(0), make(0)
    ref, fused = OPTIMIZERS[name](ref_params), fuse_optimizer(OPTIMIZERS[name](fused_params))
    assert len(fused._bagua_fuser.layouts[0].loose) == 2
    for step in range(STEPS):
        grads = grads_for(ref_params, step)
        if name == "sgd":
            grads[-1] = torch.sparse_coo_tensor([[1, 4]], torch.ones(2, 3) * (step + 1), (10, 3))
        set_grads(ref_params, grads, keep=False)
        set_grads(fused_params, grads)
        ref.step()
        fused.fuse_step()
    assert_same(ref, fused, ref_params, fused_params)


def test_replace_step_warns_about_an_existing_wrapper():
    opt = torch.optim.SGD(make_params(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # wraps opt.step on the instance
    with pytest.warns(UserWarning, match="already wrapped"):
        fuse_optimizer(opt, replace_step=True)


def test_api_errors():
    opt = fuse_optimizer(torch.optim.SGD(make_params(), lr=0.1))
    assert is_fused_optimizer(opt) and not is_fused_optimizer(torch.optim.SGD(make_params(), lr=0.1))
    with pytest.raises(RuntimeError, match="already fused"):
        fuse_optimizer(opt)
    with pytest.raises(ValueError, match="not elementwise"):
        fuse_optimizer(torch.optim.LBFGS(make_params()))
    with pytest.raises(TypeError):
        fuse_optimizer(object())
    with pytest.raises(ValueError, match="chunk_bytes"):
        fuse_optimizer(torch.optim.SGD(make_params(), lr=0.1), chunk_bytes=0)
    # fuse_step is an instance attribute: the class is untouched
    assert not hasattr(torch.optim.SGD, "fuse_step")


def test_lr_scheduler_after_replace_step():
    params = make_params()
    opt = fuse_optimizer(torch.optim.SGD(params, lr=0.1), replace_step=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    set_grads(params, grads_for(params, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.05 and opt._bagua_fused_count == 1


def test_mutual_runs():
    buf, other = torch.zeros(10), torch.zeros(4)
    params = [buf[0:2], buf[2:5], buf[5:6], other[0:2], buf[8:10]]
    grads = [buf[0:2], buf[2:5], other[0:1], other[1:3], buf[0:2]]
    assert mutual_runs([params]) == [range(0, 3), range(3, 4), range(4, 5)]
    assert mutual_runs([params, grads]) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert mutual_runs([[]]) == []


# -- with_bagua: fused and unfused optimizers give the same weights under gradient allreduce and ByteGrad --------

# (algorithm, fuse before with_bagua, with_bagua's do_flatten, zero_grad(set_to_none))
# (algorithm, fuse before with_bagua, with_bagua's do_flatten, zero_grad's set_to_none, backwards per step)
WITH_BAGUA_CASES = [
    ("gradient_allreduce", True, False, False, 1),
    ("gradient_allreduce", False, False, True, 1),
    ("gradient_allreduce", True, True, False, 1),
    ("gradient_allreduce", False, True, True, 3),
    ("bytegrad", True, False, False, 1),
    ("bytegrad", False, True, True, 1),
]


def _train_with_bagua(rank, algorithm, fused, fuse_first, bagua_flatten, set_to_none, accumulate):
    from tests.torch_api.models import batch, make_model

    model = make_model(rank)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if fused and fuse_first:
        fuse_optimizer(opt)
    model = model.with_bagua([opt], algorithm, do_flatten=bagua_flatten)
    if fused and not fuse_first:
        fuse_optimizer(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gradients are replaced every step when set_to_none
        for step in range(STEPS):
            opt.zero_grad(set_to_none=set_to_none)
            for micro in range(accumulate):  # the last backward communicates, the others accumulate locally
                x, y = batch(rank, step * accumulate + micro)
                with model.bagua_ddp.no_sync() if micro < accumulate - 1 else contextlib.nullcontext():
                    torch.nn.functional.mse_loss(model(x), y).backward()
            opt.fuse_step() if fused else opt.step()
    count = opt._bagua_fused_count if fused else None
    # with do_flatten=True the gradients are views of Bagua's buckets; the fused optimizer must leave them there
    buffers = {b.flat.untyped_storage().data_ptr() for b in model.bagua_ddp.bagua_buckets if b.flat is not None}
    in_buckets = [p.grad.untyped_storage().data_ptr() in buffers for p in model.parameters()]
    model.bagua_ddp.close()
    return [p.detach().clone() for p in model.parameters()], count, in_buckets


def _worker_with_bagua(rank, world_size, cases):
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

    algorithms = {"gradient_allreduce": GradientAllReduceAlgorithm, "bytegrad": ByteGradAlgorithm}
    out = []
    for name, fuse_first, bagua_flatten, set_to_none, accumulate in cases:
        out.append([
            _train_with_bagua(rank, algorithms[name](), fused, fuse_first, bagua_flatten, set_to_none, accumulate)
            for fused in (False, True)
        ])
    return out


def test_with_bagua_matches_unfused():
    """Two ranks, one spawn for every case (spawning dominates the cost): fused weights equal unfused, bitwise."""
    from tests.harness import run_workers

    results = run_workers(_worker_with_bagua, 2, WITH_BAGUA_CASES, timeout=240)
    for c, case in enumerate(WITH_BAGUA_CASES):
        bagua_flatten = case[2]
        for rank in range(2):
            (unfused, _, _), (fused, count, in_buckets) = results[rank][c]
            assert all(torch.equal(a, b) for a, b in zip(unfused, fused)), f"rank {rank}, case {case}"
            if bagua_flatten:
                # Bagua's buckets own the gradients (laid out last layer first, so nothing is contiguous in the
                # parameters' order): the fused optimizer leaves them there and fuses nothing, as the original's
                assert all(in_buckets) and count == 0, f"rank {rank}, case {case}: {in_buckets}, {count}"
            else:
                assert count == STEPS, f"rank {rank}, case {case}: one fused param group per step, got {count}"
        assert all(torch.equal(a, b) for a, b in zip(results[0][c][1][0], results[1][c][1][0])), f"ranks differ, {case}"
