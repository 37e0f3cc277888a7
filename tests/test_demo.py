"""The demo pair builder: cache, atomic build, from_pretrained loading, reproducibility, and the
held-out prompts. Uses the quick pair (seconds); the full pair is only built by a slow test."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve.demo import build, build_cli, corpus, train
from specserve.demo.build import demo_pair, pair_dir
from specserve.demo.measure import measure_pair, replay_rounds


@pytest.fixture(scope="module")
def quick_pair(tmp_path_factory) -> tuple[str, str, str]:
    cache = str(tmp_path_factory.mktemp("cache"))
    target_dir, draft_dir = demo_pair(quick=True, seed=0, cache_dir=cache, progress=False)
    return target_dir, draft_dir, cache


def _weights(model_dir: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / "model.safetensors"))


def test_pair_loads_with_from_pretrained(quick_pair):
    target_dir, draft_dir, _ = quick_pair
    tok_t, tok_d = AutoTokenizer.from_pretrained(target_dir), AutoTokenizer.from_pretrained(draft_dir)
    assert tok_t.get_vocab() == tok_d.get_vocab()
    assert tok_t.bos_token == "<s>" and tok_t.eos_token == "</s>"
    ids = tok_t("def f(x):\n    return x", return_tensors="pt").input_ids  # [1, S]
    assert ids[0, 0].item() == tok_t.bos_token_id
    assert tok_t.decode(ids[0], skip_special_tokens=True) == "def f(x):\n    return x"
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    draft = AutoModelForCausalLM.from_pretrained(draft_dir)
    assert target.config.vocab_size == draft.config.vocab_size == len(tok_t)
    assert target.dtype == torch.bfloat16 and draft.dtype == torch.float32
    assert target.num_parameters() >= 10 * draft.num_parameters()
    with torch.no_grad():
        # in float32: a forward in bf16 would be torch's scalar fallback on a CPU without native bf16
        assert target.float()(ids).logits.shape == draft(ids).logits.shape == (1, ids.shape[1], len(tok_t))


def test_cached_pair_is_not_rebuilt(quick_pair, monkeypatch):
    target_dir, draft_dir, cache = quick_pair

    def fail(*args, **kwargs):
        raise AssertionError("a cached pair was rebuilt")

    monkeypatch.setattr(build, "build_pair", fail)
    assert demo_pair(quick=True, seed=0, cache_dir=cache) == (target_dir, draft_dir)


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    quick, full = pair_dir(quick=True, seed=0), pair_dir(quick=False, seed=0)
    assert quick.parent == full.parent == tmp_path / "demo" and quick != full
    assert pair_dir(quick=True, seed=1) != quick


def test_interrupted_build_leaves_nothing(monkeypatch, tmp_path):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "train_target", interrupt)
    with pytest.raises(KeyboardInterrupt):
        demo_pair(quick=True, cache_dir=str(tmp_path), progress=False)
    assert list((tmp_path / "demo").iterdir()) == []  # no final dir, no leftover temp dir


def test_same_seed_gives_same_pair(quick_pair, tmp_path):
    target_dir, draft_dir, _ = quick_pair
    target2, draft2 = demo_pair(quick=True, seed=0, cache_dir=str(tmp_path), progress=False)
    assert AutoTokenizer.from_pretrained(target2).get_vocab() == AutoTokenizer.from_pretrained(target_dir).get_vocab()
    for a, b in ((target_dir, target2), (draft_dir, draft2)):
        wa, wb = _weights(a), _weights(b)
        assert wa.keys() == wb.keys()
        assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_measure_and_cli_report(quick_pair, capsys):
    target_dir, draft_dir, cache = quick_pair
    m = measure_pair(target_dir, draft_dir, k=4, new_tokens=8)
    assert 1.0 <= m["tau"] <= 5.0 and m["c"] > 0
    assert m["target_params"] >= 10 * m["draft_params"]
    args = argparse.Namespace(quick=True, rebuild=False, seed=0, cache_dir=cache)
    assert build_cli(args) == 0
    out = capsys.readouterr().out
    assert target_dir in out and "tau" in out and "c =" in out and "acceptance by draft position" in out


def test_the_draft_is_measured_on_each_packing_against_one_target_text(quick_pair, capsys):
    """--draft-weights model,int8: the draft's agreement on each, the same target text for both; int8
    steps move the draft's logits, so its greedy choices may differ a little, never by much here."""
    from app.model import cpu_linear
    from specserve.cli import parser

    if not cpu_linear.kernel_available():
        pytest.skip("no C++ compiler to build the kernel")
    target_dir, draft_dir, cache = quick_pair
    m = measure_pair(target_dir, draft_dir, k=4, new_tokens=8, draft_weights=("int8", "model"))
    assert list(m["by_weights"]) == ["int8", "model"]
    assert m["tau"] == m["by_weights"]["int8"]["tau"]  # the first packing is the one reported whole
    assert abs(m["by_weights"]["int8"]["alpha"] - m["by_weights"]["model"]["alpha"]) <= 0.25
    args = parser().parse_args(["demo-models", "--quick", "--cache-dir", cache, "--draft-weights", "int8,model"])
    assert build_cli(args) == 0
    out = capsys.readouterr().out
    assert "draft on int8 weights: tau" in out and "draft on model weights: tau" in out
    with pytest.raises(SystemExit):
        parser().parse_args(["demo-models", "--draft-weights", "int3"])


def test_replay_rounds():
    assert replay_rounds([True] * 10, k=4) == (10, 2)  # 4 accepted + bonus, twice
    assert replay_rounds([False] * 6, k=4) == (6, 6)  # every round emits only the correction
    # accept 2 then correct (3), accept 0 then correct (1), accept 1 then correct (2)
    assert replay_rounds([True, True, False, False, True, False], k=4) == (6, 3)


def test_heldout_prompts_are_unseen():
    prompts = corpus.load_heldout_prompts()
    assert 16 <= len(prompts) <= 24
    assert {p["kind"] for p in prompts} == {"code", "prose"}
    assert len({p["id"] for p in prompts}) == len(prompts)
    files = corpus.training_files()
    assert not {f.stem for f in files if f.parent == corpus.stdlib_dir()} & set(corpus.HELDOUT_MODULES)
    training = "\n".join(corpus.training_texts())
    assert not [p["id"] for p in prompts if p["prompt"] in training]


def test_greedy_sequences_are_the_targets_greedy_text(quick_pair):
    """The draft learns on exactly what greedy decoding produces, against the target's distribution
    at each position, recorded on the way."""
    from specserve.demo.measure import greedy_continuation

    target_dir, _, _ = quick_pair
    # float32: batched and single-sequence decoding then agree to far below an argmax tie
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    plan = train.PLANS["quick"]
    stream = torch.randint(2, plan.vocab_size, (500,), generator=torch.Generator().manual_seed(1))
    ticks = []
    text = train.greedy_sequences(target, stream, plan, torch.Generator().manual_seed(0), lambda: ticks.append(1))
    length = plan.kd_prompt_len + plan.kd_new_tokens
    assert text.tokens.shape == (plan.kd_sequences, length)
    assert text.top_ids.shape == text.top_logp.shape == (plan.kd_sequences, length - 1, plan.teacher_top_k)
    assert len(ticks) == -(-plan.kd_sequences // train.GEN_BATCH)
    prefix = text.tokens[:1, : plan.kd_prompt_len]
    assert torch.equal(greedy_continuation(target, prefix, plan.kd_new_tokens), text.tokens[0, plan.kd_prompt_len :])
    # position j holds the target's distribution of token j + 1: its top-1 is the greedy token
    cont = slice(plan.kd_prompt_len - 1, length - 1)
    assert torch.equal(text.top_ids[:, cont, 0], text.tokens[:, plan.kd_prompt_len :])
    with torch.no_grad():
        full = torch.log_softmax(target(text.tokens[:2, :-1]).logits, dim=-1)  # [2, L - 1, V]
    assert torch.allclose(full.gather(-1, text.top_ids[:2]), text.top_logp[:2], atol=1e-4)
    kth = full.topk(plan.teacher_top_k, dim=-1).values[..., -1:]  # they are the k most likely
    assert (text.top_logp[:2] >= kth - 1e-4).all()


def test_the_drafts_muon_takes_the_hidden_matrices_adamw_the_rest():
    plan = train.PLANS["quick"]
    torch.manual_seed(0)
    model = train.new_model(plan.draft, plan)
    opt = train._Optimizer(model, plan.draft_lr, plan.draft_steps, muon=True)
    adamw, muon = ({id(p) for g in o.param_groups for p in g["params"]} for o in opt.opts)
    named = dict(model.named_parameters())
    assert muon.isdisjoint(adamw) and muon | adamw == {id(p) for p in named.values()}
    for name, p in named.items():
        hidden = p.ndim == 2 and "embed" not in name and "lm_head" not in name
        assert (id(p) in muon) == hidden, name
    assert any("mlp" in n for n, p in named.items() if id(p) in muon)


class Bf16Matmuls(TorchDispatchMode):
    """Counts the matmuls and attention calls that run with a bf16 operand."""

    KERNELS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
               "_scaled_dot_product_attention_math", "_scaled_dot_product_efficient_attention"}

    def __init__(self):
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.KERNELS and any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16
                                        for a in tree_flatten((args, kwargs))[0]):
            self.seen[name] += 1
        return func(*args, **(kwargs or {}))


def test_a_cpu_without_native_bf16_builds_the_pair_without_one_bf16_matmul(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SPECSERVE_NATIVE_BF16", "0")  # what the probe says on a CPU without native bf16
    with Bf16Matmuls() as detector:
        build.build_pair(tmp_path, quick=True, seed=0, progress=True)
    assert detector.seen == Counter()
    info = json.loads((tmp_path / build.MARKER).read_text())
    assert info["compute_dtype"] == "float32" and set(info["phase_seconds"]) >= {"target", "draft"}
    assert "no native bf16 matmul" in capsys.readouterr().err  # the bar says why the build is slower
    # the detector does see bf16 work where there is some: the native path's autocast
    model = train.new_model(train.PLANS["quick"].draft, train.PLANS["quick"])
    with Bf16Matmuls() as detector, train.autocast(True):
        model(torch.tensor([[0, 5, 6]]))
    assert detector.seen["mm"] + detector.seen["addmm"] > 0


def test_muon_orthogonalises_in_the_dtype_it_is_given():
    from specserve.demo.muon import Muon, orthogonalise

    g = torch.randn(96, 32, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(orthogonalise(g, torch.float32))
    assert s.min() > 0.5 and s.max() < 1.5  # the quintic iteration's band around 1
    param = torch.nn.Parameter(g.clone())
    param.grad = torch.randn_like(g)
    with Bf16Matmuls() as detector:
        Muon([param], lr=0.02, dtype=torch.float32).step()
    assert detector.seen == Counter() and not torch.equal(param.detach(), g)
    # and it is torch's update: same step as torch.optim.Muon (which orthogonalises in bf16)
    a, b = (torch.nn.Parameter(g.clone()) for _ in range(2))
    theirs = torch.optim.Muon([a], lr=0.02, weight_decay=0.0, adjust_lr_fn="original")
    ours = Muon([b], lr=0.02, dtype=torch.bfloat16)
    for _ in range(3):
        grad = torch.randn_like(g)
        a.grad, b.grad = grad.clone(), grad.clone()
        theirs.step()
        ours.step()
    assert torch.allclose(a, b, atol=2e-3)


def test_a_build_far_slower_than_the_reference_says_so_once(capsys):
    from specserve.demo.progress import BuildProgress

    now = [0.0]
    bar = BuildProgress(total=100, bf16=True, enabled=True, clock=lambda: now[0])
    now[0] = 5.0
    bar.advance(5)  # under a tenth of the work: too early to judge
    now[0] = 30.0
    bar.advance(5)  # 10 reference seconds took 30: 3x
    now[0] = 90.0
    bar.advance(10)
    bar.close()
    err = capsys.readouterr().err
    assert err.count("slower than on the reference") == 1 and "3.0x" in err and "about 5 min" in err
    fast = BuildProgress(total=100, bf16=True, enabled=True, clock=lambda: 12.0)
    fast.advance(10)  # 1.2x: within the reference's spread
    fast.close()
    assert "slower" not in capsys.readouterr().err


def test_a_recipe_trial_changes_only_the_fields_it_names():
    from specserve.demo.trial import trial_plan

    plan = trial_plan({"target_steps": 7, "target": {"layers": 2, "hidden": 64, "intermediate": 128, "heads": 2}})
    full = train.PLANS["full"]
    assert plan.target_steps == 7 and plan.target == train.ModelShape(2, 64, 128, 2)
    assert plan.draft == full.draft and plan.batch == full.batch and plan.seq_len == full.seq_len
    with pytest.raises(TypeError):
        trial_plan({"target_stepz": 7})


def test_unnamed_models_come_from_the_pair_and_a_named_target_brings_its_own_draft(monkeypatch):
    """One rule wherever a command or the app lets models go unnamed (specserve.demo.models)."""
    import specserve.demo as demo

    built = []
    monkeypatch.setattr(demo, "pair", lambda name, cache_dir=None: built.append(name) or (f"{name}/t", f"{name}/d"))
    assert demo.models(None, None, "demo") == ("demo/t", "demo/d")
    assert demo.models(None, "mine/d", "demo") == ("demo/t", "mine/d")
    assert demo.models(None, None, "quick", with_draft=False) == ("quick/t", None)
    assert built == ["demo", "demo", "quick"]
    assert demo.models("mine/t", None) == ("mine/t", None)  # never the pair's draft, made for the pair's target
    assert demo.models("mine/t", "mine/d") == ("mine/t", "mine/d")
    assert built == ["demo", "demo", "quick"]  # a named target builds nothing


def test_the_shipped_builder_fills_in_the_pair_and_the_serving_layer_takes_paths_only(monkeypatch):
    """`specserve.serving:build_app` (the shipped configs' import_path) names the pair's models;
    `deployments.application:build_app` serves named models and never builds a pair."""
    import specserve.demo as demo
    from deployments.application import build_app
    from specserve.serving import with_pair

    monkeypatch.setattr(demo, "pair", lambda name, cache_dir=None: (f"{name}/t", f"{name}/d"))
    filled = with_pair({"pair": "quick", "target": {"dtype": "float32"}})
    assert filled["target"] == {"dtype": "float32", "model": "quick/t"} and filled["draft"]["model"] == "quick/d"
    assert with_pair({"pair": "quick", "draft": None}) == {"pair": "quick", "target": {"model": "quick/t"}, "draft": None}
    assert with_pair({"target": {"model": "mine"}})["target"]["model"] == "mine" and "draft" not in with_pair(
        {"target": {"model": "mine"}})  # a named target runs without the pair's draft
    with pytest.raises(ValueError, match="specserve.serving:build_app"):
        build_app({"pair": "quick"})
