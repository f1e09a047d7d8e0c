"""Units of the vLLM-compatibility layer: settings sources over argparse, `--help` defaults, metric
accounting of streamed / beam / aborted outputs, and the periodic stats line."""

from __future__ import annotations

import argparse
import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.cli import build_parser, main, server_options_from_args, take_positional_model
from kvserve.engine.request import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.server.auth import ApiKeys, Principal, add_operator_keys
from kvserve.server.metrics import TTFT_BUCKETS, ServerMetrics, build_1_2_5_buckets
from kvserve.server.options import resolve_chat_template
from kvserve.server.stats_log import StatsLogger
from kvserve.settings import SettingsError, apply_sources, defaults_from_sources

STATS = {"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.25, "num_blocks": 100, "free_blocks": 70,
         "cached_blocks": 5, "used_blocks": 25, "prefix_cache_queries": 64, "prefix_cache_hits": 32,
         "num_preemptions": 0, "evictions": 0, "prefix_cache_hit_rate": 0.5}


def serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["serve"]


# --- settings: YAML and environment over the argparse definitions ------------------------------------------


def test_precedence_is_cli_then_env_then_file(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("max-num-seqs: 7\nport: 9000\nprefix_cache: hash\nserved-model-name: a\n"
                      "disable-log-stats: true\n")
    parser = serve_parser()
    argv = ["serve", "--config", str(config), "--port", "9100"]
    apply_sources(parser, argv, environ={"KVSERVE_MAX_NUM_SEQS": "9", "KVSERVE_API_KEY": "k1, k2",
                                         "KVSERVE_UNRELATED": "ignored"})
    args = parser.parse_args(argv[1:])
    assert (args.port, args.max_num_seqs, args.prefix_cache) == (9100, 9, "hash")
    assert args.served_model_name == ["a"] and args.api_key == ["k1", "k2"] and args.disable_log_stats is True
    assert server_options_from_args(args).stats_log_interval == 0.0


@pytest.mark.parametrize(("values", "message"), [
    ({"max_num_seq": 3}, "unknown setting 'max_num_seq'"),
    ({"prefix-cache": "lru"}, "not one of"),
    ({"port": "eighty"}, "invalid value"),
    ({"disable-log-stats": "maybe"}, "expected true or false"),
    ({"host": ["a", "b"]}, "expected a single value"),
])
def test_bad_file_settings_are_named(values, message):
    with pytest.raises(SettingsError, match=message):
        defaults_from_sources(serve_parser(), values, environ={})


def test_bad_environment_value_is_named():
    with pytest.raises(SettingsError, match="KVSERVE_BLOCK_SIZE"):
        defaults_from_sources(serve_parser(), {}, environ={"KVSERVE_BLOCK_SIZE": "big"})


def test_positional_model_as_vllm_serve():
    argv = ["my-model", "--served-model-name", "x", "y"]
    args = serve_parser().parse_args(argv)
    take_positional_model(args, argv)
    assert args.model == "my-model" and args.served_model_name == ["x", "y"]
    parser = serve_parser()
    apply_sources(parser, argv, environ={"KVSERVE_MODEL": "from-env"})
    args = parser.parse_args(argv)
    take_positional_model(args, argv)
    assert args.model == "my-model"  # the command line beats the environment
    clash = ["my-model", "--model", "other"]
    with pytest.raises(ValueError, match="two models"):
        take_positional_model(serve_parser().parse_args(clash), clash)


def test_version_flag(capsys):
    from kvserve import __version__

    for argv in (["--version"], ["serve", "--version"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 0 and capsys.readouterr().out.strip() == f"kvserve {__version__}"


def test_bad_setting_exits_2_naming_it(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("max-num-seqs: many\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert "max-num-seqs" in capsys.readouterr().err


def test_serve_help_lists_every_flag_with_its_default():
    parser = serve_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.dest in ("help", "version"):
            continue
        text = formatter._format_action(action)
        assert "default:" in text, text
        for option in action.option_strings:
            assert option in parser.format_help()


def test_chat_template_file_or_inline(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert resolve_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert resolve_chat_template("{% for m in messages %}{{ m }}{% endfor %}").startswith("{%")
    with pytest.raises(ValueError, match="neither a readable file"):
        resolve_chat_template("no/such/template.jinja")
    with pytest.raises(ValueError, match="invalid Jinja"):
        resolve_chat_template("{% for m in messages %}")


def test_operator_keys_join_the_tenant_file():
    tenants = ApiKeys({"sk-bob": Principal("bob", False)})
    keys = add_operator_keys(tenants, ["sk-op"])
    assert len(keys) == 2 and keys.lookup("sk-op").is_admin and keys.lookup("sk-bob").tenant == "bob"
    assert add_operator_keys(None, []) is None
    with pytest.raises(ValueError, match="also in the --api-keys file"):
        add_operator_keys(tenants, ["sk-bob"])


# --- metrics ------------------------------------------------------------------------------------------


def output(request_id: str, completions: list[list[int]], finished: bool, times=(0.0, 0.5, 1.0, 3.0),
           reason: str | None = None) -> RequestOutput:
    arrival, scheduled, first, done = times
    metrics = RequestMetrics(arrival, scheduled, first if completions[0] else None, done if finished else None)
    outs = [CompletionOutput(i, "", ids, reason if finished else None) for i, ids in enumerate(completions)]
    return RequestOutput(request_id, None, [5] * 10, "", completions[0], finished, reason if finished else None,
                         0, metrics, outputs=outs if len(outs) > 1 else None)


def samples(metrics: ServerMetrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {s.name + str(sorted((k, v) for k, v in s.labels.items() if k != "model_name")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_tokens_are_counted_per_output_and_phases_at_finish():
    metrics = ServerMetrics(lambda: STATS, "m", max_model_len=100)
    metrics.observe_output(output("r", [[1]], False), now=1.0)
    metrics.observe_output(output("r", [[1, 2]], False), now=1.25)
    assert samples(metrics)["kvserve_generation_tokens_total[]"] == 2
    assert samples(metrics)["kvserve_prompt_tokens_total[]"] == 10
    assert samples(metrics)["kvserve_e2e_request_latency_seconds_count[]"] == 0
    metrics.observe_output(output("r", [[1, 2, 3, 4]], True, reason="length"), now=1.75)
    got = samples(metrics)
    assert got["kvserve_generation_tokens_total[]"] == 4 and got["kvserve_prompt_tokens_total[]"] == 10
    assert got["kvserve_inter_token_latency_seconds_count[]"] == 3  # 0.25, then 0.5 over two tokens
    assert got["kvserve_inter_token_latency_seconds_sum[]"] == pytest.approx(0.75)
    assert got["kvserve_e2e_request_latency_seconds_sum[]"] == 3.0
    assert got["kvserve_request_queue_time_seconds_sum[]"] == 0.5
    assert got["kvserve_request_prefill_time_seconds_sum[]"] == 0.5
    assert got["kvserve_request_decode_time_seconds_sum[]"] == 2.0
    assert got["kvserve_time_to_first_token_seconds_sum[]"] == 1.0
    assert got["kvserve_request_time_per_output_token_seconds_sum[]"] == pytest.approx(2.0 / 3)
    assert got["kvserve_request_success_total[('finished_reason', 'length')]"] == 1
    assert got["kvserve_kv_cache_usage_perc[]"] == 0.25 and metrics.num_tracked == 0


def test_parallel_and_once_reported_outputs_count_every_completion():
    metrics = ServerMetrics(lambda: STATS, "m", max_model_len=100)
    metrics.observe_output(output("p", [[1], [2]], False), now=1.0)
    metrics.observe_output(output("p", [[1, 3], [2, 4, 6]], True, reason="stop"), now=2.0)
    metrics.observe_output(output("beam", [[7, 8, 9], [7, 8]], True, reason="length"), now=2.0)
    got = samples(metrics)
    assert got["kvserve_generation_tokens_total[]"] == 5 + 5
    assert got["kvserve_prompt_tokens_total[]"] == 20  # once per engine request, not per choice
    # choice 0 grew by 1 token in 1 s, choice 1 by 2 tokens: gaps of 1.0, 0.5 and 0.5
    assert got["kvserve_inter_token_latency_seconds_count[]"] == 3
    assert got["kvserve_inter_token_latency_seconds_sum[]"] == pytest.approx(2.0)
    assert got["kvserve_request_params_n_sum[]"] == 4
    assert got["kvserve_request_max_num_generation_tokens_sum[]"] == 3 + 3


def test_aborted_requests_keep_their_tokens_and_leave_no_state():
    metrics = ServerMetrics(lambda: STATS, "m", max_model_len=100)
    metrics.observe_output(output("a", [[1, 2, 3]], False), now=1.0)
    metrics.observe_aborted(1, ["a", "never-started"])
    got = samples(metrics)
    assert got["kvserve_generation_tokens_total[]"] == 3
    assert got["kvserve_request_success_total[('finished_reason', 'abort')]"] == 1
    assert got["kvserve_request_generation_tokens_count[]"] == 0 and metrics.num_tracked == 0


def test_buckets_follow_vllm():
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)  # vLLM's docstring example
    assert len(TTFT_BUCKETS) == 22 and TTFT_BUCKETS[-1] == 2560.0
    metrics = ServerMetrics(lambda: STATS, "m", max_model_len=2048)
    les = [s.labels["le"] for f in text_string_to_metric_families(metrics.render().decode())
           for s in f.samples if s.name == "kvserve_request_prompt_tokens_bucket"]
    assert les[-2:] == ["2000.0", "+Inf"]


def test_stats_line_rates_and_quiet_when_idle(caplog):
    metrics = ServerMetrics(lambda: STATS, "m", max_model_len=100)
    stats_logger = StatsLogger(metrics.totals, lambda: STATS, logging.getLogger("kvserve.test"))
    stats_logger._last_time = 0.0
    metrics.observe_output(output("r", [[1, 2, 3, 4]], False), now=1.0)
    with caplog.at_level(logging.DEBUG, logger="kvserve.test"):
        assert stats_logger.log(now=2.0) == (5.0, 2.0)
        assert stats_logger.log(now=4.0) == (0.0, 0.0)  # still INFO: the interval before was busy
        stats_logger.log(now=6.0)
    levels = [record.levelno for record in caplog.records]
    assert levels == [logging.INFO, logging.INFO, logging.DEBUG]
    assert "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 50.0%" in caplog.text
