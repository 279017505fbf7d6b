"""The divergence and task registries: an unknown name is an error naming it (never a fall-through), and a
divergence or task of one's own, registered by its decorator, is usable through the public lookups."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from data.tasks import Task, TaskError, TaskRegistry, task_class
from losses import DIVERGENCES, divergence, divergence_spec, off_mask_divergence, register_divergence
from losses.background_cache import CACHE_KINDS, BackgroundTopK, topk_divergence
from losses.divergences import logprob_divergence

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def registered():
    """Names registered by a test, removed from `DIVERGENCES` afterwards."""
    names: list[str] = []
    yield names
    for name in names:
        DIVERGENCES.pop(name, None)


def _pair(seed: int = 0, shape=(5, 6), vocab: int = 9):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, vocab, generator=g) * 2, torch.randn(*shape, vocab, generator=g) * 2


# --- divergences ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["kl", "log-ratio", "", None])
def test_an_unknown_divergence_is_an_error_naming_it_and_the_known_ones(kind):
    e, b = _pair()
    known = "allowed kinds: forward_kl, reverse_kl, jsd, log_ratio"
    for call in (lambda: divergence(e, b, kind), lambda: logprob_divergence(e.log_softmax(-1), b.log_softmax(-1), kind),
                 lambda: divergence_spec(kind)):
        with pytest.raises(ValueError, match=f"unknown divergence kind {kind!r}; {known}") as err:
            call()
        assert "\n" not in str(err.value)


def test_a_registered_divergence_is_usable_by_name(registered):
    @register_divergence("squared_hellinger", cacheable=True)
    def squared_hellinger(lp_i, lp_b, *, beta):
        return 1.0 - ((lp_i + lp_b) / 2).exp().sum(-1)

    registered.append("squared_hellinger")
    spec = divergence_spec("squared_hellinger")
    assert spec.fn is squared_hellinger and spec.cacheable and spec.name == "squared_hellinger"
    assert list(DIVERGENCES)[-1] == "squared_hellinger" and "squared_hellinger" in CACHE_KINDS

    e, b = _pair(1)
    p_i, p_b = (e.double() / 2).softmax(-1), (b.double() / 2).softmax(-1)
    expected = 1.0 - (p_i * p_b).sqrt().sum(-1)
    out = divergence(e, b, "squared_hellinger", temperature=2.0)
    assert out.dtype == torch.float32 and out.shape == (5, 6)
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=1e-5)

    # Through the regularizer (mean over the off-mask targets) and the background cache (exact at k = V).
    targets = torch.randint(0, 9, (5, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.zeros(5, 6, dtype=torch.bool)
    mask[:, :3] = True
    reg = off_mask_divergence(e, b, targets, mask, kind="squared_hellinger", temperature=2.0)
    assert reg.item() == pytest.approx(expected[:, 3:].mean().item(), rel=1e-5)
    cached = BackgroundTopK.from_logits(b.reshape(-1, 9), 9, (2.0,))
    torch.testing.assert_close(topk_divergence(e.reshape(-1, 9), cached, "squared_hellinger", temperature=2.0),
                               out.reshape(-1), atol=1e-6, rtol=1e-5)


def test_a_divergence_not_registered_cacheable_cannot_use_the_cache(registered):
    register_divergence("l2_logprobs", cacheable=False)(lambda lp_i, lp_b, *, beta: (lp_i - lp_b).pow(2).sum(-1))
    registered.append("l2_logprobs")
    assert "l2_logprobs" not in CACHE_KINDS and "l2_logprobs" in DIVERGENCES
    e, b = _pair(3, shape=(4,))
    with pytest.raises(ValueError, match="'l2_logprobs' cannot use the background cache"):
        topk_divergence(e, BackgroundTopK.from_logits(b, 9), "l2_logprobs")


def test_a_taken_divergence_name_is_refused():
    with pytest.raises(ValueError, match="divergence 'jsd' is already registered"):
        register_divergence("jsd", cacheable=True)
    assert DIVERGENCES["jsd"].fn.__name__ == "generalized_jsd"


def test_a_divergence_that_needs_the_written_token_cannot_be_cacheable_nor_a_feature_regularizer():
    from lightning_modules.expert import ExpertSettings

    with pytest.raises(ValueError, match="'written_l2': .*cannot be cacheable"):
        register_divergence("written_l2", cacheable=True, needs_written=True)
    assert "written_l2" not in DIVERGENCES
    assert divergence_spec("written_log_ratio").needs_written and not divergence_spec("log_ratio").needs_written
    with pytest.raises(ValueError, match="divergence='written_log_ratio' needs regularizer='token'"):
        ExpertSettings(divergence="written_log_ratio", regularizer="features")


# --- tasks ---------------------------------------------------------------------------------------------------
def test_an_unknown_task_is_an_error_naming_it_and_the_known_ones():
    with pytest.raises(TaskError, match="task.name='nope' is not one of letters, intervals, text, features$"):
        task_class("nope")
    with pytest.raises(TaskError, match="task.name=None is not one of"):
        task_class(None)


class _Toy(Task):  # abstract methods left out: registration only looks at the class
    pass


class _OtherToy(Task):
    pass


def test_task_registry_refuses_taken_and_builtin_names_and_non_tasks():
    registry = TaskRegistry({"letters": "data.tasks.letters"})
    registry.register("toy", _Toy)
    registry.register("toy", _Toy)  # the same class again (a re-import) is fine
    assert registry["toy"] is _Toy and list(registry) == ["letters", "toy"] and len(registry) == 2
    with pytest.raises(TaskError, match=r"task name 'toy' is already registered to \S*_Toy$"):
        registry.register("toy", _OtherToy)
    with pytest.raises(TaskError, match="task name 'letters' belongs to the built-in task in data.tasks.letters"):
        registry.register("letters", _OtherToy)
    with pytest.raises(TaskError, match="is not a subclass of data.tasks.Task"):
        registry.register("dict", dict)
    with pytest.raises(KeyError):
        registry["nope"]
    assert "nope" not in registry and ["x"] not in registry


USER_MODULE = '''
from dataclasses import dataclass

from data.tasks import register_task
from data.tasks.letters import LettersConfig, LettersTask


@dataclass
class ShoutConfig(LettersConfig):
    alphabet: str = "ABCD"


@register_task("shout")
class ShoutTask(LettersTask):
    """A user's own task: the letter task on four letters."""

    config_class = ShoutConfig
'''

USER_RUN = '''
import sys

from data.tasks import TASKS, Expert, settings_from_node, task_class

# Names and membership import no task module; a lookup imports only the task it needs.
assert list(TASKS) == ["letters", "intervals", "text", "features"] and "text" in TASKS, list(TASKS)
task_modules = lambda: sorted(m for m in sys.modules if m.startswith("data.tasks.") and m != "data.tasks.base")
assert task_modules() == [], task_modules()
import my_tasks  # registers "shout" (and imports the letter task it builds on)

assert "data.tasks.text" not in sys.modules and "data.tasks.intervals" not in sys.modules, task_modules()
assert list(TASKS) == ["letters", "intervals", "text", "features", "shout"]
cls = task_class("shout")
assert cls is my_tasks.ShoutTask and cls.name == "shout" and task_class("letters").name == "letters"
cfg = settings_from_node({"name": "shout", "n_train": 4, "n_val": 2, "n_test": 2, "min_len": 3, "max_len": 4})
task = cls(cfg, [Expert("A_to_B", {"rules": {"A": "B"}})], seed=0)
rows = task.expert_dataset("train")
assert len(rows) >= 4 and set(task.tokenizer.get_vocab()) >= set("ABCD"), len(rows)
task_class("intervals")
assert "data.tasks.text" not in sys.modules, task_modules()
print("ok")
'''


def test_a_users_task_registers_itself_and_built_in_tasks_load_lazily(tmp_path):
    (tmp_path / "my_tasks.py").write_text(USER_MODULE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(USER_RUN)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
