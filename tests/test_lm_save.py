"""CompiledLM.save and moirai.load_lm: a saved LM comes back without planning again, generating the tokens it did
(and Hugging Face's), predicting what it did; a file of another model, of moirai.compile, or edited, is a PlanError
naming what to do or the field."""

from __future__ import annotations

import json

import pytest
import torch

import moirai
from tests.test_generation import VOCAB, hf_new_tokens, tiny_llama

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return tiny_llama()


@pytest.fixture(scope="module")
def saved(llama, tmp_path_factory):
    """One compile_lm, saved: two sequences on two devices (two decode steps in flight), a TTFT limit."""
    lm = moirai.compile_lm(
        llama,
        ["cpu", "cpu"],
        max_batch_size=2,
        max_seq_len=32,
        max_prefill=8,
        sequences=2,
        max_ttft_s=60.0,
        placer="heft",
        calibration="none",
        progress=False,
    )
    path = tmp_path_factory.mktemp("lm") / "lm-plan.json"
    lm.save(path)
    return lm, path


@pytest.fixture(scope="module")
def loaded(llama, saved) -> moirai.CompiledLM:
    return moirai.load_lm(saved[1], llama, progress=False)


def edited(path, tmp_path, edit) -> str:
    record = json.loads(path.read_text())
    edit(record)
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(record))
    return str(out)


def test_a_loaded_lm_generates_the_tokens_of_the_compiled_one_and_of_hf(llama, saved, loaded):
    lm, _ = saved
    prompt = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))  # 11 > max_prefill = 8
    expected = lm.generate(prompt, max_new_tokens=12)
    assert torch.equal(loaded.generate(prompt, max_new_tokens=12), expected)
    for row in range(2):
        assert expected[row, 11:].tolist() == hf_new_tokens(llama, prompt[row], 12)


def test_an_lm_planned_on_meta_weights_loads_with_the_real_ones_and_generates_their_tokens(llama, tmp_path):
    """Planning never needs weights: a plan made on ``meta`` loads with the real model. The two traces differ in a
    layout op (a ``clone`` after attention on meta only), which once renumbered every later op's name
    ([Note: op names numbered in order]), so the load named ops the real trace did not have."""
    with torch.device("meta"):
        meta_llama = tiny_llama()
    lm = moirai.compile_lm(
        meta_llama, ["cpu", "cpu"], max_batch_size=2, max_seq_len=32, max_prefill=8, placer="round_robin",
        calibration="none", progress=False,
    )  # fmt: skip
    with pytest.raises(moirai.InputError, match=r"on the meta device; .*\(moirai.load, or moirai.load_lm"):
        lm.generate(torch.tensor([[3, 4]]), max_new_tokens=2)  # it says how to run it: the steps below
    with pytest.raises(moirai.InputError, match=r"on the meta device; .*moirai.load_lm"):
        lm.server()  # at once, not by each rank in its log at the first request
    path = tmp_path / "meta-plan.json"
    lm.save(path)
    loaded = moirai.load_lm(path, llama, progress=False)
    planned_ops = {node.name for node in lm.compiled.traced.graph_module.graph.nodes}
    loaded_ops = {node.name for node in loaded.compiled.traced.graph_module.graph.nodes}
    assert {"clone", "clone_1"} <= planned_ops - loaded_ops  # the case this test is about
    assert set(loaded.compiled.plan.placement.tolist()) == {0, 1}  # split: the load matched ops on both devices
    prompt = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    tokens = loaded.generate(prompt, max_new_tokens=12)
    for row in range(2):
        assert tokens[row, 11:].tolist() == hf_new_tokens(llama, prompt[row], 12)


def test_a_loaded_lm_predicts_and_describes_what_the_compiled_one_did(saved, loaded):
    lm, _ = saved
    assert loaded.prediction() == lm.prediction()
    assert loaded.summary_table().caption == lm.summary_table().caption
    assert loaded.compiled.plan.placement.tolist() == lm.compiled.plan.placement.tolist()
    kept = ("max_seq_len", "max_prefill", "decode_batch", "prompt_tokens", "stages", "vocab_size", "logits_width")
    assert {name: getattr(loaded, name) for name in kept} == {name: getattr(lm, name) for name in kept}
    assert loaded.cache == lm.cache
    limits = ("new_tokens", "sequences", "max_ttft_s", "prefill_chunks")
    assert [getattr(loaded.objective, n) for n in limits] == [getattr(lm.objective, n) for n in limits]
    assert loaded.objective.prefill.device_names == loaded.compiled.problem.device_names


def test_a_loaded_lms_server_generates_as_the_model(llama, loaded):
    prompt = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(2))
    with loaded.server(progress=False) as server:
        assert server.submit(prompt, max_new_tokens=5).result(timeout=120) == hf_new_tokens(llama, prompt, 5)


def test_a_model_of_another_config_is_refused(saved):
    path = saved[1]
    with pytest.raises(moirai.PlanError, match="ops|tensors"):
        moirai.load_lm(path, tiny_llama(layers=1), progress=False)
    with pytest.raises(moirai.PlanError, match="other tensors"):
        moirai.load_lm(path, tiny_llama(hidden_size=32), progress=False)


def test_another_number_of_devices_is_refused(llama, saved):
    with pytest.raises(moirai.PlanError, match="on 2 devices, 1 were given"):
        moirai.load_lm(saved[1], llama, devices=["cpu"], progress=False)


def test_moirai_load_of_an_lm_file_says_to_use_load_lm(llama, saved):
    with pytest.raises(moirai.PlanError, match=r"moirai\.compile_lm .*moirai\.load_lm\(path, model\)"):
        moirai.load(saved[1], llama, example_inputs=(torch.zeros(1, 3, dtype=torch.long),), progress=False)


def test_load_lm_of_a_plain_plan_file_says_to_use_load(llama, saved, tmp_path):
    plain = edited(saved[1], tmp_path, lambda record: record.pop("lm"))
    with pytest.raises(moirai.PlanError, match=r"a plan of moirai\.compile .*moirai\.load\(path, model"):
        moirai.load_lm(plain, llama, progress=False)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("max_seq_len", "x", "is 'x', not a whole number"),
        ("max_seq_len", -3, "is -3, outside 1.."),
        ("max_batch_size", 2.5, "not a whole number"),
        pytest.param("new_tokens", 10**400, "outside 1..", id="new_tokens-401 digits"),
        ("max_ttft_s", "soon", "not a number"),
        ("max_ttft_s", -1.0, "is negative"),
        ("prefill_problem", [], "not an object"),
        ("model", 3, "not the model's class name"),
    ],
)
def test_an_edited_field_of_the_lm_section_is_a_plan_error_naming_it(llama, saved, tmp_path, field, value, words):
    path = edited(saved[1], tmp_path, lambda record: record["lm"].__setitem__(field, value))
    with pytest.raises(moirai.PlanError, match=rf"'lm\.{field}' .*{words}.*CompiledLM\.save"):
        moirai.load_lm(path, llama, progress=False)


def test_lm_limits_that_do_not_fit_each_other_or_a_missing_field_are_plan_errors(llama, saved, tmp_path):
    path = edited(saved[1], tmp_path, lambda record: record["lm"].__setitem__("max_prefill", 64))
    with pytest.raises(moirai.PlanError, match=r"'lm\.max_prefill' \(64\) is over 'lm\.max_seq_len' \(32\)"):
        moirai.load_lm(path, llama, progress=False)
    path = edited(saved[1], tmp_path, lambda record: record["lm"].pop("decode_batch"))
    with pytest.raises(moirai.PlanError, match="'lm' lacks 'decode_batch'"):
        moirai.load_lm(path, llama, progress=False)
    path = edited(saved[1], tmp_path, lambda record: record["lm"]["prefill_problem"].__setitem__("tasks", []))
    with pytest.raises(moirai.PlanError, match=r"lm\.prefill_problem\) holds a problem of 0 tasks"):
        moirai.load_lm(path, llama, progress=False)


def test_a_model_of_another_class_is_refused_before_it_is_traced(saved, tmp_path):
    path = edited(saved[1], tmp_path, lambda record: record["lm"].__setitem__("model", "MistralForCausalLM"))
    with pytest.raises(moirai.PlanError, match="planned for a MistralForCausalLM, not a LlamaForCausalLM"):
        moirai.load_lm(path, tiny_llama(), progress=False)


def test_a_plan_saved_before_a_step_attended_over_its_context_is_refused_with_what_to_do(llama, saved, tmp_path):
    # Such a file's caches have max_seq_len positions, no spare one; it was refused as "traced for 31".
    def whole_slots(record):
        for name, tensor in record["tensors"]["weights"].items():
            if "_cache_" in name:
                tensor["shape"][2] = record["lm"]["max_seq_len"]

    path = edited(saved[1], tmp_path, whole_slots)
    with pytest.raises(moirai.PlanError, match="saved by an earlier moirai.*compile the LM again"):
        moirai.load_lm(path, llama, progress=False)


@pytest.mark.parametrize(
    ("field", "value", "traced"), [("max_seq_len", 16, "32"), ("max_batch_size", 1, "2"), ("max_prefill", 4, "8")]
)
def test_a_limit_edited_to_another_than_the_plans_trace_is_refused_before_the_step_is_built(
    llama, saved, tmp_path, field, value, traced
):
    """A max_seq_len of 10**9 would allocate its cache before the trace could differ from the plan's."""
    path = edited(saved[1], tmp_path, lambda record: record["lm"].__setitem__(field, value))
    with pytest.raises(
        moirai.PlanError, match=rf"'lm\.{field}' is {value}, but the plan's step was traced for {traced}"
    ):
        moirai.load_lm(path, llama, progress=False)
