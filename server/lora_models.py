"""The LoRA adapters a server serves by name (vLLM's OpenAIServingModels): from --lora-modules at
start-up, and loaded or unloaded at runtime through /v1/load_lora_adapter and
/v1/unload_lora_adapter when JAXLLM_ALLOW_RUNTIME_LORA_UPDATING (or vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING) is true. A request's `model` field picks an adapter by name."""

from __future__ import annotations

import argparse
import itertools
import json
import os
from dataclasses import dataclass
from http import HTTPStatus

from jaxllm.lora.request import LoRARequest
from jaxllm.server.errors import OpenAIError

RUNTIME_UPDATING_ENVS = ("JAXLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updating_allowed() -> bool:
    return any(os.environ.get(name, "").lower() in ("1", "true") for name in RUNTIME_UPDATING_ENVS)


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModulePath:
    """--lora-modules' forms, as vLLM's: name=path, or JSON {"name", "path", "base_model_name"}."""
    if value.lstrip().startswith("{"):
        try:
            spec = json.loads(value)
            return LoRAModulePath(spec["name"], spec["path"], spec.get("base_model_name"))
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise argparse.ArgumentTypeError(
                f"invalid --lora-modules JSON {value!r} ({error!r}): expected "
                '{"name": ..., "path": ..., "base_model_name": ...}') from None
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(
            f"invalid --lora-modules value {value!r}: expected name=path or a JSON object")
    return LoRAModulePath(name, path)


class ServedAdapters:
    """name -> LoRARequest, ids handed out in order."""

    def __init__(self) -> None:
        self.requests: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def new_request(self, module: LoRAModulePath) -> LoRARequest:
        if module.name in self.requests:
            raise OpenAIError(f"The lora adapter '{module.name}' has already been loaded.")
        return LoRARequest(module.name, next(self._ids), module.path, module.base_model_name)

    def add(self, request: LoRARequest) -> None:
        self.requests[request.lora_name] = request

    def pop(self, name: str) -> LoRARequest:
        request = self.requests.pop(name, None)
        if request is None:
            raise OpenAIError(f"The lora adapter '{name}' cannot be found.",
                              HTTPStatus.NOT_FOUND, "lora_name")
        return request
