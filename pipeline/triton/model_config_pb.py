"""tritonclient's model-config protobuf (ModelConfig, ModelInput, ...), imported when a config is first made or read,
so that a missing tritonclient says how to install it instead of failing at import."""

from __future__ import annotations

from pipeline.errors import MissingDependencyError


def model_config_pb2():
    try:
        from tritonclient.grpc import model_config_pb2
    except ImportError as err:
        raise MissingDependencyError("Triton configs need tritonclient; pip install 'tritonclient[grpc]'") from err
    return model_config_pb2
