"""Speculative decoding's acceptance, as `jaxllm bench` prints it (vLLM's definitions)."""

from __future__ import annotations


def spec_decode_metrics(stats: dict) -> dict | None:
    """From EngineCore.get_stats(): acceptance rate (accepted drafts / drafts proposed), mean
    acceptance length (tokens per verification step: accepted drafts + 1), and the acceptance
    rate at each draft position; None when the engine does not speculate."""
    if "spec_decode_num_drafts_total" not in stats:
        return None
    drafts = stats["spec_decode_num_drafts_total"]
    draft_tokens = stats["spec_decode_num_draft_tokens_total"]
    accepted = stats["spec_decode_num_accepted_tokens_total"]
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens,
            "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
            "acceptance_rate_per_position": [
                count / drafts if drafts else 0.0
                for count in stats["spec_decode_num_accepted_tokens_per_pos"]]}


def format_spec_decode(metrics: dict) -> str:
    per_pos = ", ".join(f"{rate:.2f}" for rate in metrics["acceptance_rate_per_position"])
    return (f"Speculative decoding: acceptance rate {metrics['acceptance_rate']:.1%}, mean "
            f"acceptance length {metrics['mean_acceptance_length']:.2f} "
            f"({metrics['num_drafts']} drafts, {metrics['num_draft_tokens']} draft tokens, "
            f"{metrics['num_accepted_tokens']} accepted; per position: {per_pos})")


def report(result: dict, stats: dict) -> None:
    """Adds the acceptance metrics to a benchmark's result and prints them (if speculating)."""
    metrics = spec_decode_metrics(stats)
    if metrics is not None:
        result["spec_decode"] = metrics
        print(format_spec_decode(metrics), flush=True)
