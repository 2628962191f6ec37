"""`jaxllm serve` parses vLLM's launch lines: vLLM's names, aliases and value syntax for what jaxllm
implements, one clear line for a vLLM flag it does not, argparse's error (with the closest flag)
for a typo. Parse-only: no engine starts."""

from __future__ import annotations

import argparse

import pytest

from jaxllm.cli import main
from jaxllm.engine.args import (ENGINE_FLAGS_DEFAULT_ONLY, ENGINE_FLAGS_NOT_IMPLEMENTED,
                                EngineArgs, human_readable_int, parse_cli_args)
from jaxllm.server.cli import (SERVER_FLAGS_DEFAULT_ONLY, SERVER_FLAGS_NOT_IMPLEMENTED,
                               add_serve_args, uvicorn_config)


def parse(line: str) -> argparse.Namespace:
    return parse_cli_args(add_serve_args(argparse.ArgumentParser(prog="jaxllm serve")),
                          line.split())


def refusal(line: str, capsys) -> str:
    """The error a line gets: exit status 2 and the last line of stderr."""
    with pytest.raises(SystemExit) as exit_info:
        parse(line)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_vllm_launch_line():
    args = parse("/models/llama -tp 2 -dp 2 -ep --max-model-len 4k --max-num-batched-tokens 32K "
                 "--dtype half --served-model-name llama chat --disable-log-requests "
                 "--trust-remote-code --no-enable-prefix-caching --enable-chunked-prefill "
                 "--generation-config vllm -pp 2 --kv-cache-dtype auto --disable-log-stats "
                 "--swap-space 4 --uvicorn-log-level trace")
    assert args.model_tag == "/models/llama"
    assert (args.tensor_parallel_size, args.data_parallel_size) == (2, 2)
    assert args.pipeline_parallel_size == 2
    assert args.enable_expert_parallel is True
    assert (args.max_model_len, args.max_num_batched_tokens) == (4000, 32768)
    assert args.dtype == "float16"
    assert args.served_model_name == ["llama", "chat"]
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.served_model_name == "llama"  # the first name is the reported one
    assert engine_args.dtype == "float16" and engine_args.max_model_len == 4000


def test_prefix_caching_flags():
    assert EngineArgs.from_cli_args(parse("m")).enable_prefix_caching is True
    args = EngineArgs.from_cli_args(parse("m --no-enable-prefix-caching"))
    assert args.enable_prefix_caching is False
    args = EngineArgs.from_cli_args(parse("m --enable-prefix-caching --prefix-caching-hash-algo "
                                          "xxhash"))
    assert (args.enable_prefix_caching, args.prefix_caching_hash_algo) == (True, "xxhash")


def test_long_flag_names_and_defaults():
    args = parse("m --tensor-parallel-size 4 --data-parallel-size 1 --enforce-eager")
    assert (args.tensor_parallel_size, args.data_parallel_size, args.enforce_eager) == (4, 1, True)
    defaults = parse("")
    assert defaults.model_tag is None and defaults.served_model_name is None
    assert EngineArgs.from_cli_args(defaults) == EngineArgs()


@pytest.mark.parametrize("value, expected", [
    ("2048", 2048), ("4k", 4000), ("32K", 32768), ("1m", 1_000_000), ("1M", 2**20),
    ("25.6k", 25600), ("2g", 2 * 10**9), ("1G", 2**30), (" 8k ", 8000)])
def test_human_readable_int(value, expected):
    assert human_readable_int(value) == expected


@pytest.mark.parametrize("value", ["1.5K", "abc", "4kb", "-1", "1e3", ""])
def test_human_readable_int_rejects(value):
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int(value)


def test_decimal_binary_size_is_refused_with_a_hint(capsys):
    assert "did you mean 1.5k?" in refusal("m --max-model-len 1.5K", capsys)


def test_max_model_len_auto_is_refused(capsys):
    assert "--max-model-len auto" in refusal("m --max-model-len auto", capsys)


@pytest.mark.parametrize("value, expected", [("half", "float16"), ("float", "float32"),
                                             ("float16", "float16"), ("bfloat16", "bfloat16"),
                                             ("float32", "float32"), ("auto", "auto")])
def test_dtype_names(value, expected):
    assert parse(f"m --dtype {value}").dtype == expected


def test_dtype_unknown(capsys):
    message = refusal("m --dtype int8", capsys)
    assert "'int8'" in message and "half" in message


def test_served_model_name_keeps_the_positional_model():
    args = parse("/models/x --served-model-name a b c")
    assert args.model_tag == "/models/x" and args.served_model_name == ["a", "b", "c"]
    args = parse("--served-model-name a --port 9000 /models/x")
    assert args.model_tag == "/models/x" and args.served_model_name == ["a"]
    assert args.port == 9000


@pytest.mark.parametrize("line, flag", [
    ("--fully-sharded-loras", "--fully-sharded-loras"),
    ("--calculate-kv-scales", "--calculate-kv-scales"),
    ("--tool-call-parser hermes", "--tool-call-parser"),
    ("--enable-auto-tool-choice", "--enable-auto-tool-choice"),
    ("--kv-transfer-config {}", "--kv-transfer-config"),
    ("--no-enable-chunked-prefill", "--no-enable-chunked-prefill"),
    ("--allowed-origins x", "--allowed-origins"),
])
def test_unimplemented_vllm_flag_is_named(line, flag, capsys):
    message = refusal(f"m {line}", capsys)
    assert message.startswith("jaxllm serve: error: jaxllm does not support " + flag)
    assert "unrecognized" not in message


@pytest.mark.parametrize("line, shown", [
    ("--tokenizer-mode slow", "--tokenizer-mode slow"),
    ("--generation-config auto", "--generation-config auto"),
    ("--generation-config /models/x", "--generation-config /models/x"),
    ("--scheduling-policy priority", "--scheduling-policy priority"),
    ("--response-role bot", "--response-role bot")])
def test_default_only_flag_at_another_value(line, shown, capsys):
    assert f"does not support {shown} yet, only" in refusal(f"m {line}", capsys)


def test_every_table_entry_is_refused_or_accepted(capsys):
    """Each name in the tables reaches its own action (no jaxllm flag shadows it)."""
    for names in ENGINE_FLAGS_NOT_IMPLEMENTED + SERVER_FLAGS_NOT_IMPLEMENTED:
        for name in names.split("|"):
            assert f"does not support {names.split('|')[0]} yet" in refusal(f"m {name} x",
                                                                             capsys)
    for names, value in ENGINE_FLAGS_DEFAULT_ONLY + SERVER_FLAGS_DEFAULT_ONLY:
        for name in names.split("|"):
            assert parse(f"m {name} {value}").model_tag == "m"


def test_typo_gets_argparse_error_with_the_closest_flag(capsys):
    message = refusal("m --tensor-paralel-size 2", capsys)
    assert "unrecognized arguments" in message
    assert "did you mean --tensor-parallel-size?" in message


def test_api_key_takes_one_key(capsys, monkeypatch):
    assert parse("m --api-key k1").api_key == "k1"
    assert "several --api-key values" in refusal("m --api-key k1 k2", capsys)


def test_uvicorn_flags_reach_its_config():
    args = parse("m --disable-uvicorn-access-log --root-path /llm --ssl-keyfile k.pem "
                 "--ssl-certfile c.pem --ssl-ca-certs ca.pem --ssl-cert-reqs 2 --host 0.0.0.0 "
                 "--port 9001 --request-header-timeout 7 --request-body-timeout 9.5")
    config = uvicorn_config(object(), args)
    assert config.access_log is False and config.root_path == "/llm"
    assert config.http.keywords == {"request_header_timeout": 7.0, "request_body_timeout": 9.5}
    assert (config.ssl_keyfile, config.ssl_certfile, config.ssl_ca_certs) == (
        "k.pem", "c.pem", "ca.pem")
    assert config.ssl_cert_reqs == 2 and (config.host, config.port) == ("0.0.0.0", 9001)
    default = uvicorn_config(object(), parse("m"))
    assert default.access_log is True and default.ssl_keyfile is None
    assert default.http.keywords == {"request_header_timeout": 30.0, "request_body_timeout": 30.0}


def test_metrics_prefix_choices(capsys):
    assert parse("m").metrics_prefix == "both"
    assert parse("m --metrics-prefix vllm").metrics_prefix == "vllm"
    assert "invalid choice" in refusal("m --metrics-prefix prom", capsys)


def test_jaxllm_command_refuses_before_loading_anything(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "m", "--fully-sharded-loras"])
    assert exit_info.value.code == 2
    assert ("jaxllm serve: error: jaxllm does not support --fully-sharded-loras"
            in capsys.readouterr().err)


def test_quantization_flags_reach_engine_args():
    engine_args = EngineArgs.from_cli_args(parse("m -q fp8 --kv-cache-dtype fp8_e4m3"))
    assert (engine_args.quantization, engine_args.kv_cache_dtype) == ("fp8", "fp8_e4m3")
    engine_args = EngineArgs.from_cli_args(parse("m --quantization gptq"))
    assert (engine_args.quantization, engine_args.kv_cache_dtype) == ("gptq", "auto")


def test_subcommand_typos_name_the_subcommand(capsys):
    for argv, hint in ((["generate", "hi", "--max-tokenz", "3"], "--max-tokens"),
                       (["bench", "throughput", "--input-lenn", "3"], "--input-len")):
        with pytest.raises(SystemExit):
            main(argv)
        assert f"(did you mean {hint}?)" in capsys.readouterr().err
