"""OpenAI reinforcement graders -> our GRPO rewards (RewardSpec dicts).

OpenAI graders map as follows (``{{sample.output_text}}`` is the completion, ``{{item.<col>}}`` a
dataset column):

* ``string_check`` ``eq`` / ``ne`` / ``like`` / ``ilike`` against ``{{item.col}}`` -> exact_match
  (case-sensitive / negated / contains / case-insensitive contains); against a literal ->
  regex_match with the escaped literal.
* ``text_similarity`` ``fuzzy_match`` -> text_similarity (``pass_threshold`` kept).
* ``python`` -> a custom reward calling ``grade(sample, item)`` in the sandbox.
* ``multi`` -> each sub-grader, weighted by ``calculate_output`` when it is a weighted sum of
  the grader names (``"0.7 * correct + 0.3 * fmt"``, ``"0 * exact"``, ``"fmt - 0.5 * long"``:
  zero, negative and decimal weights; a zero-weight grader is still scored and charted).
"""
from __future__ import annotations

import ast
import re
from typing import Any

from app.web.errors import ApiError

_SAMPLE = re.compile(r"^\s*\{\{\s*sample\.output_text\s*\}\}\s*$")
_ITEM = re.compile(r"^\s*\{\{\s*item\.([A-Za-z_][\w]*)\s*\}\}\s*$")


def bad_value(msg: str, param: str) -> ApiError:
    """A 400 ``invalid_value`` error naming ``param``."""
    return ApiError(400, msg, param, "invalid_value")


def object_param(value: Any, param: str) -> dict[str, Any]:
    """``value`` as a dict (None: empty). Raises ApiError 400 naming ``param`` otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ApiError(400, f"{param} must be an object, not {type(value).__name__}", param,
                       "invalid_value")
    return dict(value)


def _needs_output(grader: dict, param: str) -> None:
    if not _SAMPLE.match(str(grader.get("input", ""))):
        raise bad_value("only {{sample.output_text}} can be graded (the model's completion)",
                   f"{param}.input")


def grader_rewards(grader: Any, param: str = "method.reinforcement.grader",
                   weight: float = 1.0) -> list[dict[str, Any]]:
    """Our reward list (RewardSpec dicts) for an OpenAI grader. Raises ApiError."""
    if not isinstance(grader, dict):
        raise bad_value("grader must be an object", param)
    kind = grader.get("type")
    label = grader.get("name") or None
    if kind == "string_check":
        _needs_output(grader, param)
        op = grader.get("operation", "eq")
        ref = str(grader.get("reference", ""))
        col = _ITEM.match(ref)
        if op not in ("eq", "ne", "like", "ilike"):
            raise bad_value(f"string_check operation {op!r} is not one of eq, ne, like, ilike",
                       f"{param}.operation")
        if col:
            params = {"column": col.group(1), "case_sensitive": op in ("eq", "ne", "like"),
                      "strip": False, "contains": op in ("like", "ilike"), "negate": op == "ne"}
            return [{"name": "exact_match", "weight": weight, "label": label, "params": params}]
        if "{{" in ref:
            raise bad_value("reference must be a literal or {{item.<column>}}", f"{param}.reference")
        lit = re.escape(ref)
        pattern = {"eq": f"^{lit}$", "ne": f"^(?!{lit}$)", "like": lit, "ilike": f"(?i){lit}"}[op]
        return [{"name": "regex_match", "weight": weight, "label": label,
                 "params": {"pattern": pattern, "dotall": True}}]
    if kind == "text_similarity":
        _needs_output(grader, param)
        metric = grader.get("evaluation_metric", "fuzzy_match")
        if metric != "fuzzy_match":
            raise ApiError(400, f"text_similarity evaluation_metric {metric!r} is not supported "
                                f"(fuzzy_match is)", f"{param}.evaluation_metric",
                           "unsupported_parameter")
        col = _ITEM.match(str(grader.get("reference", "")))
        if not col:
            raise bad_value("reference must be {{item.<column>}}", f"{param}.reference")
        params: dict[str, Any] = {"column": col.group(1)}
        if grader.get("pass_threshold") is not None:
            params["pass_threshold"] = grader["pass_threshold"]
        return [{"name": "text_similarity", "weight": weight, "label": label, "params": params}]
    if kind == "python":
        src = grader.get("source")
        if not isinstance(src, str) or not src.strip():
            raise bad_value("a python grader needs source defining grade(sample, item)", f"{param}.source")
        return [{"name": "custom", "weight": weight, "label": label,
                 "params": {"source": src, "entry": "grade", "style": "openai"}}]
    if kind == "multi":
        graders = grader.get("graders")
        if not isinstance(graders, dict) or not graders:
            raise bad_value("a multi grader needs graders: {name: grader}", f"{param}.graders")
        weights = _linear_weights(str(grader.get("calculate_output", "")), list(graders),
                                  f"{param}.calculate_output")
        out = []
        for name, sub in graders.items():
            if name not in weights:  # not in calculate_output; a 0 weight is still charted
                continue
            for r in grader_rewards(sub, f"{param}.graders.{name}", weight * weights[name]):
                r["label"] = r.get("label") or name
                out.append(r)
        return out
    raise ApiError(400, f"grader type {kind!r} is not supported (string_check, text_similarity, "
                        f"python, multi are)", f"{param}.type", "unsupported_parameter")


def _linear_weights(expr: str, names: list[str], param: str) -> dict[str, float]:
    """``"0.7 * a + 0.3 * b"`` -> {"a": 0.7, "b": 0.3}; anything but a weighted sum is refused."""
    try:
        tree = ast.parse(expr, mode="eval").body
    except SyntaxError:
        raise bad_value("calculate_output must be a weighted sum of grader names", param) from None
    weights: dict[str, float] = {}

    def term(node, sign):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            term(node.left, sign)
            term(node.right, -sign if isinstance(node.op, ast.Sub) else sign)
            return
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)) \
                and _number(node) is None:
            term(node.operand, -sign if isinstance(node.op, ast.USub) else sign)
            return
        coef, name = sign, None
        if isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
            a, b = node.left, node.right
            if isinstance(node.op, ast.Mult) and _number(a) is not None:
                a, b = b, a
            k = _number(b)
            if isinstance(a, ast.Name) and k is not None \
                    and (isinstance(node.op, ast.Mult) or k != 0):
                name = a.id
                coef = sign * (k if isinstance(node.op, ast.Mult) else 1 / k)
        if name is None or name not in names:
            raise bad_value("calculate_output must be a weighted sum of the grader names "
                       f"({', '.join(names)}), e.g. '0.5 * {names[0]} + ...'", param)
        weights[name] = weights.get(name, 0.0) + float(coef)

    term(tree, 1.0)
    return weights


def _number(node) -> float | None:
    """The value of a numeric literal (``2``, ``0.5``, ``-1e-3``), else None."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _number(node.operand)
        return None if v is None else (-v if isinstance(node.op, ast.USub) else v)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        return float(node.value)
    return None
