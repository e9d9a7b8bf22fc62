"""The built-in components, registered through the same hooks as any third-party plugin."""

from __future__ import annotations

from streamrl.algorithms.dpo import DPO, DPOConfig
from streamrl.algorithms.dr_grpo import DrGRPO, DrGRPOConfig
from streamrl.algorithms.grpo import GRPO, GRPOConfig
from streamrl.algorithms.ppo import PPO, PPOConfig
from streamrl.algorithms.reinforce_pp import ReinforcePP, ReinforcePPConfig
from streamrl.algorithms.rloo import RLOO, RLOOConfig
from streamrl.tasks.agent import AgentConfig, AgentTask
from streamrl.api import Component, hookimpl
from streamrl.engines.hf import HFEngine, HFEngineConfig
from streamrl.ranking.rankers import (HistoryRanker, HistoryRankerConfig, LearnedRanker, LearnedRankerConfig,
                                      OracleRanker, OracleRankerConfig)
from streamrl.rewards.exact_match import ExactMatch, ExactMatchConfig
from streamrl.rewards.math_reward import MathReward, MathRewardConfig
from streamrl.rewards.python import PythonReward, PythonRewardConfig
from streamrl.chat.tool_calls import (HermesConfig, HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                                      Qwen3ToolParser)
from streamrl.scheduling.longtail import LongTail, LongTailConfig
from streamrl.scheduling.schedulers import FCFS, FCFSConfig, Skew, SkewConfig
from streamrl.sim.engine import SimEngine, SimEngineConfig
from streamrl.sim.trainer import SimTrainer, SimTrainerConfig
from streamrl.sim.workload import LongTailSimConfig, LongTailSimTask, SimLengthConfig, SimLengthReward
from streamrl.tasks.addition import AdditionConfig, AdditionTask
from streamrl.tasks.countdown import CountdownConfig, CountdownReward, CountdownRewardConfig, CountdownTask
from streamrl.tasks.dataset import DatasetConfig, DatasetTask
from streamrl.telemetry.csv_sink import CSVSink, CSVSinkConfig
from streamrl.telemetry.trackers.mlflow import MLflowConfig, MLflowSink
from streamrl.telemetry.trackers.tensorboard import TensorBoardConfig, TensorBoardSink
from streamrl.telemetry.trackers.trackio import TrackioConfig, TrackioSink
from streamrl.telemetry.trackers.wandb import WandbConfig, WandbSink
from streamrl.training.hf import HFTrainerConfig, HFTrainerFactory
from streamrl.transfer.dask import DaskTransfer, DaskTransferConfig
from streamrl.transfer.cuda_ipc import CudaIpcConfig, CudaIpcTransfer
from streamrl.transfer.torch_distributed import TorchDistributedConfig, TorchDistributedTransfer


@hookimpl
def register_algorithms():
    return [Component("algorithm", "grpo", GRPOConfig, GRPO), Component("algorithm", "rloo", RLOOConfig, RLOO),
            Component("algorithm", "dr_grpo", DrGRPOConfig, DrGRPO),
            Component("algorithm", "reinforce_pp", ReinforcePPConfig, ReinforcePP),
            Component("algorithm", "ppo", PPOConfig, PPO), Component("algorithm", "dpo", DPOConfig, DPO)]


@hookimpl
def register_engines():
    return [Component("engine", "hf", HFEngineConfig, HFEngine), Component("engine", "sim", SimEngineConfig, SimEngine)]


@hookimpl
def register_trainers():
    return [Component("trainer", "hf", HFTrainerConfig, HFTrainerFactory),
            Component("trainer", "sim", SimTrainerConfig, SimTrainer)]


@hookimpl
def register_rewards():
    return [Component("reward", "exact_match", ExactMatchConfig, ExactMatch),
            Component("reward", "sim_length", SimLengthConfig, SimLengthReward),
            Component("reward", "countdown", CountdownRewardConfig, CountdownReward),
            Component("reward", "python", PythonRewardConfig, PythonReward),
            Component("reward", "math", MathRewardConfig, MathReward)]


@hookimpl
def register_tasks():
    return [Component("task", "addition", AdditionConfig, AdditionTask),
            Component("task", "countdown", CountdownConfig, CountdownTask),
            Component("task", "longtail-sim", LongTailSimConfig, LongTailSimTask),
            Component("task", "dataset", DatasetConfig, DatasetTask),
            Component("task", "agent", AgentConfig, AgentTask)]


@hookimpl
def register_transfers():
    return [Component("transfer", "dask", DaskTransferConfig, DaskTransfer),
            Component("transfer", "torch_distributed", TorchDistributedConfig, TorchDistributedTransfer),
            Component("transfer", "cuda_ipc", CudaIpcConfig, CudaIpcTransfer)]


@hookimpl
def register_rankers():
    return [Component("ranker", "history", HistoryRankerConfig, HistoryRanker),
            Component("ranker", "learned", LearnedRankerConfig, LearnedRanker),
            Component("ranker", "oracle", OracleRankerConfig, OracleRanker)]


@hookimpl
def register_schedulers():
    return [Component("scheduler", "fcfs", FCFSConfig, FCFS), Component("scheduler", "skew", SkewConfig, Skew),
            Component("scheduler", "longtail", LongTailConfig, LongTail)]


@hookimpl
def register_metric_sinks():
    return [Component("metric_sink", "csv", CSVSinkConfig, CSVSink),
            Component("metric_sink", "tensorboard", TensorBoardConfig, TensorBoardSink),
            Component("metric_sink", "wandb", WandbConfig, WandbSink),
            Component("metric_sink", "mlflow", MLflowConfig, MLflowSink),
            Component("metric_sink", "trackio", TrackioConfig, TrackioSink)]


@hookimpl
def register_tool_parsers():
    return [Component("tool_parser", "hermes", HermesConfig, HermesToolParser),
            Component("tool_parser", "qwen3", HermesConfig, Qwen3ToolParser),
            Component("tool_parser", "llama3_json", HermesConfig, Llama3JsonToolParser),
            Component("tool_parser", "mistral", HermesConfig, MistralToolParser)]
