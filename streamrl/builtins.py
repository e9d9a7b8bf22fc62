"""The built-in components, registered through the same hooks as any third-party plugin."""

from __future__ import annotations

from streamrl import hookimpl
from streamrl.algorithms.grpo import GRPO, GRPOConfig
from streamrl.engines.hf import HFEngine, HFEngineConfig
from streamrl.plugins import Component
from streamrl.rewards.exact_match import ExactMatch, ExactMatchConfig
from streamrl.tasks.addition import AdditionConfig, AdditionTask
from streamrl.telemetry.csv_sink import CSVSink, CSVSinkConfig
from streamrl.transfer.dask import DaskTransport, DaskTransportConfig


@hookimpl
def register_algorithms():
    return [Component("algorithm", "grpo", GRPOConfig, GRPO)]


@hookimpl
def register_engines():
    return [Component("engine", "hf", HFEngineConfig, HFEngine)]


@hookimpl
def register_rewards():
    return [Component("reward", "exact_match", ExactMatchConfig, ExactMatch)]


@hookimpl
def register_tasks():
    return [Component("task", "addition", AdditionConfig, AdditionTask)]


@hookimpl
def register_transports():
    return [Component("transport", "dask", DaskTransportConfig, DaskTransport)]


@hookimpl
def register_metric_sinks():
    return [Component("metric_sink", "csv", CSVSinkConfig, CSVSink)]
