"""tinker-cookbook's two loops as its recipes run them, for a base model of moetune's. Supervised:
`recipes/sl_basic.py`'s main over a `supervised.train.Config` with the local-JSONL builder its comment names
(`FromConversationFileBuilder`). RL: `rl.train.main`, what `recipes/rl_basic.py` runs (that module imports its GSM8K
task, which needs the cookbook's math extras), on a verifiable environment of our own: the reward is the share of the
answer's tokens that are in an answer key. tests/tinker/test_cookbook.py runs them with chz's `key=value` arguments:

    python -m tests.tinker.cookbook_recipes sl model_name=<base> log_path=<dir> dataset_builder.file_path=<jsonl>
    python -m tests.tinker.cookbook_recipes rl model_name=<base> log_path=<dir> dataset_builder.key_file=<json>

The recipes' own command lines do not run in 0.6.1 for such a model: `python -m tinker_cookbook.supervised.train`
stops in chz (its entry point is an unannotated lambda), and `python -m tinker_cookbook.recipes.sl_basic` asks the
cookbook's model registry for a renderer, which knows only `org/model` names.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import chz
import tinker
from tinker_cookbook import cli_utils, renderers
from tinker_cookbook.recipes import sl_basic
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.supervised import train as sl_train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
from tinker_cookbook.rl.types import (Action, Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder, StepResult,
                                      StopCondition)
from tinker_cookbook.tokenizer_utils import get_tokenizer

RENDERER = "role_colon"


class AnswerKeyEnv(Env):
    """One question; the reward is the share of the answer's tokens that are in the key (a set of token ids)."""

    def __init__(self, renderer: renderers.Renderer, key: frozenset[int]):
        self.renderer, self.key = renderer, key

    async def initial_observation(self) -> tuple[tinker.ModelInput, StopCondition]:
        prompt = self.renderer.build_generation_prompt([{"role": "user", "content": "Say a token."}])
        return prompt, self.renderer.get_stop_sequences()

    async def step(self, action: Action, *, extra=None) -> StepResult:
        return StepResult(reward=sum(t in self.key for t in action) / max(len(action), 1), episode_done=True,
                          next_observation=tinker.ModelInput.empty(),
                          next_stop_condition=self.renderer.get_stop_sequences())


@dataclass(frozen=True)
class AnswerKeyGroup(EnvGroupBuilder):
    model_name: str
    key: frozenset[int]
    group_size: int

    async def make_envs(self) -> Sequence[Env]:
        renderer = renderers.get_renderer(RENDERER, get_tokenizer(self.model_name))
        return [AnswerKeyEnv(renderer, self.key) for _ in range(self.group_size)]


@dataclass(frozen=True)
class AnswerKeyDataset(RLDataset):
    group: AnswerKeyGroup
    batches: int
    groups_per_batch: int

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return [self.group] * self.groups_per_batch

    def __len__(self) -> int:
        return self.batches


@chz.chz
class AnswerKeyDatasetBuilder(RLDatasetBuilder):
    model_name: str
    key_file: str  # a JSON list of token ids
    batches: int = 8
    groups_per_batch: int = 8
    group_size: int = 8

    async def __call__(self) -> tuple[RLDataset, None]:
        key = frozenset(json.loads(Path(self.key_file).read_text()))
        return AnswerKeyDataset(AnswerKeyGroup(self.model_name, key, self.group_size), self.batches,
                                self.groups_per_batch), None


def sl_blueprint(model_name: str) -> chz.Blueprint[sl_train.Config]:
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model_name, renderer_name=RENDERER,
                                            max_length=256, batch_size=4)
    return chz.Blueprint(sl_train.Config).apply({
        "model_name": model_name,
        "recipe_name": "moetune_sl",
        "renderer_name": RENDERER,
        "dataset_builder": FromConversationFileBuilder,
        "dataset_builder.common_config": common,
        "learning_rate": 5e-3,
        "lr_schedule": "constant",
        "num_epochs": 4,
        "lora_rank": 4,
        "eval_every": 0,
        "save_every": 0,
    })


def rl_blueprint(model_name: str) -> chz.Blueprint[rl_train.Config]:
    return chz.Blueprint(rl_train.Config).apply({
        "model_name": model_name,
        "recipe_name": "moetune_answer_key",
        "renderer_name": RENDERER,
        "dataset_builder": AnswerKeyDatasetBuilder,
        "dataset_builder.model_name": model_name,
        "learning_rate": 2e-2,
        "max_tokens": 8,
        "lora_rank": 4,
        "eval_every": 0,
        "save_every": 0,
    })


if __name__ == "__main__":
    loop, argv = sys.argv[1], sys.argv[2:]
    name = cli_utils.model_name_from_argv(argv, default="")
    if loop == "sl":
        sl_basic.main(sl_blueprint(name).make_from_argv(argv))
    else:
        asyncio.run(rl_train.main(rl_blueprint(name).make_from_argv(argv)))
