"""Length generalization (configs/experiment/length.yaml): NoPE models, the per-length sweep of the letter task,
its report section and plot, and the errors for lengths the model cannot hold."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compose import ComposedLM
from data.tasks import Expert
from data.tasks.letters import LettersConfig, LettersTask
from data.tokenizer import build_char_tokenizer
from lightning_modules.background import BackgroundLM, jumped_position_ids
from lightning_modules.pipeline.config import ConfigError, ModelConfig, load_config
from lightning_modules.pipeline.models import build_causal_lm, load_pretrained, position_options
from lightning_modules.pipeline.report import LENGTH_PLOT, plot_accuracy_vs_length, write_report
from lightning_modules.pipeline.stages import plan_run

ROOT = Path(__file__).resolve().parents[1]
DEFAULT, LENGTH = ROOT / "configs" / "default.yaml", ROOT / "configs" / "experiment" / "length.yaml"
EXPERTS = [Expert("A_to_B", {"rules": {"A": "B"}}), Expert("C_to_D", {"rules": {"C": "D"}})]


def _task(**settings) -> LettersTask:
    cfg = LettersConfig(**{"n_train": 64, "n_val": 8, "n_test": 8, "eval_lengths": [3, 20], "n_per_length": 6,
                           **settings})
    return LettersTask(cfg, EXPERTS, reg_data="composition", seed=0)


def _gapped(ids: torch.Tensor) -> torch.Tensor:
    return torch.tensor([[0, 3, 4, 9, 20, 21, 30, 41, 50, 66][: ids.shape[1]]])


@pytest.mark.parametrize("encoding", ["rope", "nope"])
def test_nope_ignores_position_ids_and_survives_save_and_load(tmp_path, encoding):
    tok = _task().tokenizer
    model = build_causal_lm(ModelConfig(hidden_size=32, num_heads=2, num_layers=2, intermediate_size=64,
                                        position_encoding=encoding), tok).eval()
    ids = torch.randint(5, len(tok), (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain, gapped = model(ids).logits, model(ids, position_ids=_gapped(ids)).logits
    if encoding == "rope":  # positions matter (the test can tell)
        assert (plain - gapped).abs().max() > 1e-4
        return
    assert torch.equal(plain, gapped)
    model.save_pretrained(tmp_path / "m", safe_serialization=True)
    reloaded = load_pretrained(tmp_path / "m", tok).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids, position_ids=_gapped(ids)).logits, plain)


def test_default_positions_build_the_model_as_before():
    assert position_options(ModelConfig()) == {}
    assert position_options(ModelConfig(rope_theta=500.0)) == {
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}


@pytest.mark.parametrize("override, message", [
    ("model.max_position_embeddings=64", "model.max_position_embeddings=64 is shorter than the task's longest row "
                                         "(67 tokens, from task.eval_lengths=[4, 32])"),
    ("task.eval_lengths=[4,40];model.max_position_embeddings=80", "from task.eval_lengths=[4, 40]): raise it to >= 84"),
    ("task.eval_lengths=[1,32]", "task.eval_lengths=[1, 32]: compositional inputs plant a source letter of 2"),
    ("task.eval_lengths=[8,4]", "task.eval_lengths=[8, 4]: give [shortest, longest]"),
    ("task.eval_lengths=[4]", "task.eval_lengths=[4]: give [shortest, longest]"),
    ("task.n_per_length=0", "task.n_per_length=0"),
    ("model.arch=gpt2;model.position_encoding=nope", "model.position_encoding=nope applies to a Llama built from "
                                                    "scratch (model.arch=llama, no model.pretrained_path); got "
                                                    "model.arch=gpt2"),
    ("model.arch=gpt2;model.position_encoding=coupled", "model.position_encoding=coupled applies to a Llama built "
                                                        "from scratch"),
    ("model.arch=gpt2;model.position_encoding=rope;model.rope_theta=500.0", "model.rope_theta=500.0 applies to a "
                                                                           "Llama built from scratch"),
    ("model.position_encoding=alibi", "model.position_encoding='alibi' is not one of auto, rope, nope, coupled"),
    ("background.position_jump=-1", "background.position_jump=-1: must be an integer >= 0"),
    ("background.position_jump=100", "background.position_jump=100: position ids may reach 267 (the longest row, 67 "
                                     "tokens, and the jump), beyond model.max_position_embeddings=128"),
])
def test_bad_lengths_and_positions_are_one_line_errors_before_anything_is_written(tmp_path, override, message):
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        plan_run(load_config([LENGTH], [f"output_dir={out}", *override.split(";")], base=DEFAULT))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not out.exists()


def test_jumped_position_ids_shift_each_row_from_its_separator():
    gen = torch.Generator().manual_seed(0)
    start = torch.tensor([4, 6, 3])
    plain = torch.arange(9).expand(3, 9)
    pos = jumped_position_ids(start - 1, plain, 5, gen)
    for row, s in zip(pos, start.tolist(), strict=True):
        assert row[: s - 1].tolist() == list(range(s - 1))  # <bos> x: plain
        jump = int(row[s - 1]) - (s - 1)  # from the separator on: shifted by one jump
        assert 0 <= jump <= 5 and row[s - 1:].tolist() == [t + jump for t in range(s - 1, 9)]
    draws = jumped_position_ids(torch.full((2000,), 2), torch.arange(4).expand(2000, 4), 5, gen)[:, 3] - 3
    assert set(draws.tolist()) == set(range(6))  # every jump in [0, max_jump] is drawn
    assert jumped_position_ids(start - 1, plain, 0).equal(plain)


def test_coupled_positions_put_each_output_step_one_before_its_input_and_randomize_the_rest(tmp_path):
    """`coupled`: x_t at 2t, the separator at 1 and the step predicting y_t at 2t - 1 (after left padding as
    before, through a save and reload); random slots in training keep that offset and vary every other one."""
    from compose.positions import position_ids, position_restart_token
    from lightning_modules.background import coupled_position_ids, training_position_ids

    ids = torch.tensor([[0, 0, 1, 5, 6, 3, 7, 8, 2], [1, 5, 6, 7, 3, 9, 9, 9, 2]])  # <bos>=1 <sep>=3 <eos>=2
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9])
    assert position_ids(ids, mask, 3).tolist() == [[0, 0, 0, 2, 4, 1, 3, 5, 7], [0, 2, 4, 6, 1, 3, 5, 7, 9]]
    assert position_ids(ids, mask).tolist()[1] == list(range(9))
    assert coupled_position_ids(torch.tensor([5]), 9, 0).equal(position_ids(ids[1:], mask[1:], 3))
    tokenizer = build_char_tokenizer("ABC")
    model = build_causal_lm(ModelConfig(position_encoding="coupled"), tokenizer)
    model.save_pretrained(tmp_path)
    assert position_restart_token(load_pretrained(tmp_path)) == tokenizer.sep_token_id == 3
    batch = {"input_ids": ids[1:], "attention_mask": mask[1:], "output_start": torch.tensor([5])}
    torch.manual_seed(0)
    rows = [training_position_ids(model, batch, 6)[0].tolist() for _ in range(50)]
    for row in rows:  # <bos> x_1..x_3 <sep> y_1..y_3 <eos>
        inputs, steps = row[1:4], row[4:8]  # the steps predicting y_1, y_2, y_3, <eos>
        assert row[0] == 0 and inputs == sorted(inputs) and all(v % 2 == 0 for v in inputs)
        assert [v + 1 for v in steps[:3]] == inputs and steps[3] > inputs[-1] and steps[3] <= 2 * 10 - 1
        assert row[8] == steps[3] + 2
    assert len({tuple(r) for r in rows}) > 10 and {r[4] for r in rows} != {1}  # random, not always consecutive


class _Recorder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w, self.positions = torch.nn.Parameter(torch.zeros(7)), []

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        self.positions.append(position_ids)
        return type("Out", (), {"logits": self.w.expand(*input_ids.shape, 7)})()


def test_background_training_jumps_positions_and_validation_does_not():
    batch = {"input_ids": torch.ones(2, 6, dtype=torch.long), "attention_mask": torch.ones(2, 6, dtype=torch.long),
             "targets": torch.full((2, 6), 3), "output_start": torch.tensor([3, 4])}
    for jump in (0, 4):
        module = BackgroundLM(_Recorder(), position_jump=jump)
        module.log = lambda *a, **k: None
        module.training_step(batch, 0)
        module.validation_step(batch, 0)
        train, val = module.model.positions
        assert val is None and (train is None) == (jump == 0)
        if jump:
            assert train[:, :2].equal(torch.arange(2).expand(2, 2)) and (train[:, -1] - 5).max() <= jump


def test_length_inputs_have_the_length_avoid_training_inputs_and_are_reproducible():
    task = _task(min_len=3, max_len=4)
    training = task._training_inputs()
    for length in (3, 4, 9):
        rows = task.length_inputs(length)
        assert rows == _task(min_len=3, max_len=4).length_inputs(length)
        every = [rows["background"], *rows["experts"].values(), rows["composition"]]
        assert all(len(xs) == 6 and {len(x) for x in xs} == {length} for xs in every)
        assert not training & set().union(*every)
        assert all("A" in x and "C" in x for x in rows["composition"])
    first = task.length_inputs(3)
    again = task.length_inputs(3, exclude=set(first["background"]) | set(first["composition"]))
    assert not set(again["background"]) & set(first["background"])
    assert not set(again["composition"]) & set(first["composition"])


def test_evaluate_lengths_reports_every_model_at_every_length():
    task = _task(eval_lengths=[7, 9])
    torch.manual_seed(0)
    model = build_causal_lm(ModelConfig(hidden_size=16, num_heads=2, num_layers=1, intermediate_size=32,
                                        max_position_embeddings=64), task.tokenizer).eval()
    lm = ComposedLM(model, tokenizer=task.tokenizer)  # an untrained model stands in for every component
    seen = []
    results = task.evaluate_lengths(lm, {"A_to_B": lm, "C_to_D": lm}, lm, batch_size=4, progress=seen.append)
    assert seen == [7, 8, 9] and list(results) == ["7", "8", "9"]
    entry = results["8"]
    assert entry["trained_length"] and not results["7"]["trained_length"] and entry["n"] == 6
    assert set(entry) == {"trained_length", "n", "background", "experts", "composition", "components_min",
                          "components_product"}
    assert entry["components_min"] == min(entry["experts"].values())
    assert _task(eval_lengths=None).evaluate_lengths(lm, {}, None, 4) == {}


def _length_summary() -> dict:
    length = {}
    for n in range(4, 11):
        experts = {"A_to_B": 1.0 if 6 <= n <= 8 else 0.5, "C_to_D": 0.9}
        length[str(n)] = {"trained_length": 6 <= n <= 8, "n": 10, "background": 1.0 - n / 100, "experts": experts,
                          "composition": 0.4, "components_min": min(experts.values()),
                          "components_product": experts["A_to_B"] * experts["C_to_D"]}
    return {"experiment": "length", "background": {"exact_match": 1.0}, "length": length}


def test_report_has_the_length_table_and_plot(tmp_path):
    path = write_report(_length_summary(), tmp_path)
    text = path.read_text()
    assert "## Length generalization" in text and f"![exact match vs input length]({LENGTH_PLOT})" in text
    assert "| length | background | A_to_B | C_to_D | composition | min | product | comp − min |" in text
    assert "| 7* | 0.930 | 1.000 | 0.900 | 0.400 | 0.900 | 0.900 | -0.500 |" in text
    assert "| 4 | 0.960 | 0.500 | 0.900 | 0.400 | 0.500 | 0.450 | -0.100 |" in text
    assert (tmp_path / LENGTH_PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_accuracy_vs_length({"background": {}}, tmp_path / "none.png") is None
    assert LENGTH_PLOT not in write_report({"background": {"exact_match": 1.0}}, tmp_path).read_text()
    assert not (tmp_path / LENGTH_PLOT).exists()  # a stale plot goes with its section


@pytest.mark.slow
def test_length_experiment_runs_end_to_end_in_its_fast_variant(tmp_path):
    """configs/experiment/length.yaml on the fast debug sizes: summary.json has `length.<L>` for every model and
    report.md the table and the plot."""
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), str(LENGTH), str(ROOT / "configs/debug/fast.yaml"),
                           f"output_dir={out}", "experiment=length_fast", "ablations=[]", "ablation_ks=[]",
                           "baselines=[]", "task.eval_lengths=[3,18]", "task.n_per_length=8",
                           "background.position_jump=8", "expert.position_jump=8"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["length"]) == [str(n) for n in range(3, 19)]
    assert set(summary["length"]["3"]["experts"]) == {"A_to_B", "C_to_D"}
    assert all(0.0 <= v["composition"] <= 1.0 for v in summary["length"].values())
    assert "## Length generalization" in (out / "report.md").read_text() and (out / LENGTH_PLOT).is_file()
    assert "output positions jump by up to 8" in proc.stdout


def test_expert_training_gives_the_expert_and_its_background_the_same_jumped_positions():
    from lightning_modules.expert import ExpertLM, ExpertSettings
    from tests.tiny_models import tiny_model

    settings = ExpertSettings(position_jump=4, target_modules=["q_proj", "v_proj"], log_every_n_steps=1)
    module = ExpertLM(tiny_model(), ["a"], settings)
    module.log = lambda *a, **k: None
    seen = {}  # the positions each forward gets (stand-ins return zero logits over the 32-token vocabulary)
    module.background_logits = lambda ids, attn, pos: seen.setdefault("background", pos) is None or torch.zeros(
        *ids.shape, 32)
    module.expert_logits = lambda ids, attn, index, pos: seen.setdefault("expert", pos) is None or torch.zeros(
        *ids.shape, 32, requires_grad=True)
    batch = {"input_ids": torch.ones(2, 6, dtype=torch.long), "attention_mask": torch.ones(2, 6, dtype=torch.long),
             "targets": torch.full((2, 6), 3), "masks": torch.zeros(2, 1, 6, dtype=torch.bool),
             "expert_index": torch.zeros(2, dtype=torch.long), "is_task": torch.ones(2, dtype=torch.long),
             "task_on_mask": torch.ones(2, dtype=torch.long), "output_start": torch.tensor([3, 4])}
    module.training_step(batch, 0)
    assert seen["background"] is seen["expert"] and seen["expert"][:, :2].equal(torch.arange(2).expand(2, 2))
    with pytest.raises(ValueError, match="position_jump cannot be used with background_top_k"):
        ExpertLM(tiny_model(), ["a"], ExpertSettings(position_jump=4, background_top_k=8))


def test_expert_position_jump_and_the_background_cache_are_refused_together(tmp_path):
    with pytest.raises(ConfigError, match="expert.position_jump cannot be used with expert.background_cache"):
        load_config([LENGTH], [f"output_dir={tmp_path / 'run'}", "expert.position_jump=4",
                               "expert.background_cache={top_k: 8}"], base=DEFAULT)


def test_composed_decoding_counts_coupled_positions_as_teacher_forcing_does():
    """Greedy decoding with a KV cache extends coupled positions step by step (restarting at a generated
    separator); scoring the decoded rows at once, with positions from the whole row, picks the same tokens."""
    tokenizer = build_char_tokenizer("ABCD")
    torch.manual_seed(0)
    model = build_causal_lm(ModelConfig(position_encoding="coupled", hidden_size=32, num_heads=2), tokenizer).eval()
    lm = ComposedLM(model, [], tokenizer=tokenizer)
    sep = tokenizer.sep_token_id
    prompt = torch.tensor([[tokenizer.bos_token_id, 5, 6, 7, sep], [tokenizer.pad_token_id, tokenizer.bos_token_id,
                                                                   8, 5, sep]])
    attn = (prompt != tokenizer.pad_token_id).long()
    out = lm.generate(prompt, attn, max_new_tokens=12, do_sample=False)
    full_attn = torch.cat([attn, torch.ones(2, out.shape[1] - prompt.shape[1], dtype=torch.long)], 1)
    background, _ = lm.component_logprobs(out, full_attn)
    new = slice(prompt.shape[1] - 1, out.shape[1] - 1)
    done = (out[:, prompt.shape[1]:] == tokenizer.eos_token_id).cumsum(1) - (out[:, prompt.shape[1]:] ==
                                                                             tokenizer.eos_token_id).long()
    live = done == 0  # up to and including the first <eos>
    assert (background[:, new].argmax(-1) == out[:, prompt.shape[1]:])[live].all()
    plain = model.config.position_restart_token_id
    del model.config.position_restart_token_id  # the same weights with plain positions score differently
    assert lm.position_restart is None
    unrestarted, _ = lm.component_logprobs(out, full_attn)
    model.config.position_restart_token_id = plain
    assert (unrestarted - background).abs().max() > 1e-4


@pytest.mark.parametrize("files, overrides, expected", [
    ([], [], "coupled"),  # the letter task's generative format: outputs copy inputs position by position
    ([], ["task.format=aligned"], "rope"),  # nothing generated
    ([], ["model.arch=gpt2"], "rope"),
    ([ROOT / "configs" / "experiment" / "intervals.yaml"], [], "rope"),  # outputs are not aligned with inputs
    ([], ["model.position_encoding=nope"], "nope"),  # an explicit choice stays
])
def test_auto_positions_couple_only_where_outputs_align_with_inputs(files, overrides, expected):
    cfg = load_config([str(f) for f in files], overrides, base=DEFAULT)
    assert cfg.model.position_encoding == expected
