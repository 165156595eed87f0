"""The validation gates in the report, from each variant's validate.json: per variant and text, every
gate's value, limit and margin; what each graph stores against what its recipe asked; which
variants are comparison points (limits they meet) rather than goals; and, in words, where a build
replaced a variant's shared limits and whether its quality goal still holds."""

from __future__ import annotations

# Per-text gates, in the columns' order: validate.json `checks` key prefix, column title.
TEXT_GATES = (
    ("ppl_ratio", "ppl ratio"),
    ("kl_divergence", "KL"),
    ("top1_agreement", "top-1"),
    ("greedy_agreement", "greedy"),
    ("kv_max_prob_diff", "KV gap"),
    ("kv_cache_kl", "KV cache KL"),  # a quantized cache's only
)


def cell(check: dict) -> str:
    """`value <= limit (margin)`; the relation flips when the check fails; * marks a replaced limit."""
    upper, passed = check["upper_bound"], check["passed"]
    relation = ("<=" if passed else ">") if upper else (">=" if passed else "<")
    star = "*" if "shared_limit" in check else ""
    return f"{check['value']:.4g} {relation} {check['limit']:.4g}{star} ({check['margin']:+.2g})"


def texts(validation: dict) -> list[str]:
    return list(dict.fromkeys(c["text"] for c in validation["checks"].values() if c["text"] is not None))


def replaced_in_words(model: str, variant: str, validation: dict) -> str | None:
    """One sentence when the build replaced any of the variant's shared limits."""
    replaced = validation["limits_replaced_by_build"]
    if not replaced:
        return None
    limits = ", ".join(f"{gate} {r['limit']:g} (shared limit {r['shared']:g})" for gate, r in replaced.items())
    if validation["role"] == "comparison":
        verdict = "a comparison point, no goal"
    else:
        verdict = "quality goal met" if validation["goal_met"] else "quality goal not met"
    return f"{model} {variant}: limit replaced by the build: {limits}: {verdict}."


def counts(validations: dict[str, dict]) -> dict:
    """Goal variants and comparison points apart: how many passed, and how many goals are met."""
    found = {}
    for role in ("goal", "comparison"):
        mine = [v for v in validations.values() if v["role"] == role]
        found[role] = {"variants": len(mine), "passed": sum(bool(v["passed"]) for v in mine)}
    found["goal"]["goal_met"] = sum(bool(v["goal_met"]) for v in validations.values() if v["role"] == "goal")
    return found


def count_sentence(found: dict) -> str:
    goal, comparison = found["goal"], found["comparison"]
    sentence = (
        f"{goal['passed']} of {goal['variants']} goal variants passed validation and "
        f"{goal['goal_met']} met their quality goal (the shared limits)"
    )
    if comparison["variants"]:
        sentence += (
            f"; {comparison['passed']} of {comparison['variants']} comparison points passed "
            f"(their limits are what they meet, not goals)"
        )
    return sentence + "."


def coverage_cells(validation: dict) -> str:
    covered = validation["coverage"]
    kept = covered["kept_float"]
    kv = covered["kv_cache"]
    kept_names = f" ({len(kept['matrices'])} matrices)" if kept["matrices"] else ""
    return (
        f"{covered['share_as_asked']:.1%} | {covered['quantized_share']:.1%} | "
        f"{kept['share']:.1%}{kept_names}, limit {kept['limit']:.0%} | {kv['asked']}, {kv['stored_bits']}-bit stored"
    )


def markdown(model: str, validations: dict[str, dict]) -> list[str]:
    """The report's lines: the gate table, the coverage table, the overrides and the counts."""
    lines = [
        "",
        "## Validation gates",
        "",
        "Each cell: the variant's value on that text, the limit, and the margin inside it (negative: "
        "failed). `*`: a limit the build replaced (see below). KV gap: the largest change of any token's "
        "probability between cached decode and a full pass (float compute); KV cache KL: for a quantized "
        "cache, the mean KL of the text run through it from the same run over a float cache.",
        "",
        "| variant | kind | text | " + " | ".join(title for _, title in TEXT_GATES) + " |",
        "|" + "---|" * (3 + len(TEXT_GATES)),
    ]
    for variant, validation in validations.items():
        for text in texts(validation):
            checks = validation["checks"]
            cells = " | ".join(
                cell(checks[f"{gate}[{text}]"]) if f"{gate}[{text}]" in checks else "-" for gate, _ in TEXT_GATES
            )
            lines.append(f"| {variant} | {validation['role']} | {text} | {cells} |")
    lines += [
        "",
        "| variant | weights stored as the recipe asks | matmul weights below 16 bits | kept float | KV cache |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {variant} | {coverage_cells(v)} |" for variant, v in validations.items()]
    sentences = [replaced_in_words(model, variant, v) for variant, v in validations.items()]
    lines += ["", count_sentence(counts(validations))]
    replaced = [f"- {sentence}" for sentence in sentences if sentence]
    return lines + (["", *replaced] if replaced else [])


def summary(validations: dict[str, dict]) -> dict:
    """report.json's record of the gates: per variant its role, verdicts and checks, and the counts."""
    keys = ("role", "passed", "goal_met", "limits_replaced_by_build", "checks")
    return {
        "counts": counts(validations),
        "variants": {variant: {key: v[key] for key in keys} for variant, v in validations.items()},
    }
