"""A dataset's column mapping: which of an SFT file's columns are the alpaca fields
(``{role: column}``, roles of :data:`app.data.formats.MAPPING_ROLES`), the dataset page's form
for it (with a hint when the rows look like GRPO prompts instead), and setting it (the dataset
is validated again with it)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine

from app.data.errors import DatasetError
from app.settings import Settings
from app.store.schema import Dataset
from app.studio import access, audit, validation
from app.studio.datasets import uploaded_for_grpo
from app.studio.errors import StudioError, invalid

if TYPE_CHECKING:
    from app.store.schema import User


def column_mapping(ds: Dataset) -> dict[str, str] | None:
    """The dataset's column mapping (``{role: column}``, roles of
    :data:`app.data.formats.MAPPING_ROLES`), kept with its report; None when it has none."""
    mapping = (ds.report or {}).get("column_mapping")
    return mapping if isinstance(mapping, dict) and mapping else None


def _read_sample(path: str, sample: int = 100) -> tuple[list[dict], bool]:
    """(the first ``sample`` readable rows of a dataset file, whether they were read without a
    file-level error: invalid UTF-8, a JSON document that does not parse; rows before the
    error are kept)."""
    from app.data.loader import iter_records

    rows: list[dict] = []
    try:
        for n, rec in enumerate(iter_records(path)):
            if n >= sample:
                break
            if isinstance(rec.data, dict):
                rows.append(rec.data)
    except DatasetError:
        return rows, False
    return rows, True


def _sample_rows(path: str, sample: int = 100) -> list[dict]:
    """The first ``sample`` readable rows of a dataset file (empty when it cannot be read)."""
    return _read_sample(path, sample)[0]


def _columns(rows: list[dict]) -> list[str]:
    """The column names of ``rows``, in first-seen order."""
    return list(dict.fromkeys(c for row in rows for c in row))


def file_columns(path: str, sample: int = 100) -> list[str]:
    """The column names of a dataset file's first ``sample`` rows, in first-seen order (empty
    when the file cannot be read)."""
    return _columns(_sample_rows(path, sample))


def _has_assistant_turn(value: Any) -> bool:
    """True when a chat cell (a list of ``{role|from, content|value}`` turns) holds an
    assistant turn (roles as :data:`app.data.formats.SHAREGPT_ROLES` maps them)."""
    from app.data.formats import SHAREGPT_ROLES

    return isinstance(value, list) and any(
        isinstance(turn, dict)
        and SHAREGPT_ROLES.get(str(turn.get("role", turn.get("from", ""))).lower()) == "assistant"
        for turn in value)


def looks_like_prompts(rows: list[dict]) -> bool:
    """True when rows that are no SFT dataset really look like GRPO prompt data: a prompt
    column (:data:`app.store.specs.PROMPT_COLUMNS`) and no assistant turn in any chat column
    (:data:`app.data.formats.CONV_KEYS`). A broken chat file (its rows have assistant turns,
    a few stray ``prompt``/``text`` cells among them) does not."""
    from app.data.formats import CONV_KEYS
    from app.store.specs import PROMPT_COLUMNS

    if not any(c in row for row in rows for c in PROMPT_COLUMNS):
        return False
    return not any(_has_assistant_turn(row.get(key)) for row in rows for key in CONV_KEYS)


def mapping_form(ds: Dataset) -> dict[str, Any] | None:
    """What the dataset page's column-mapping form shows, or None when it does not apply (a
    prompt dataset, a file whose rows have no columns to choose from, one that validated in a
    format of its own, a file that cannot be read through (invalid UTF-8, broken JSON: no
    mapping mends that), chat rows with fewer than two other columns to map): ``columns``,
    ``roles``, ``mapping`` (the current one, else a guess from the prompt/answer column names),
    and ``prompts_hint`` (the rows look like GRPO prompts, :func:`looks_like_prompts`)."""
    from app.data.formats import CONV_KEYS, MAPPING_ROLES
    from app.data.prompts import pick_columns

    current = column_mapping(ds)
    if uploaded_for_grpo(ds) or ds.status == validation.VALIDATING or \
            (ds.status == validation.PROCESSED and not current):
        return None
    rows, readable = _read_sample(ds.path)
    columns = _columns(rows)
    chat = any(isinstance(row.get(k), list) for row in rows for k in CONV_KEYS)
    if not columns or not readable or (chat and len([c for c in columns if c not in CONV_KEYS]) < 2):
        return None
    guess, hint = {}, False
    try:
        pcol, acol = pick_columns(dict.fromkeys(columns))
        hint = pcol != "messages" and looks_like_prompts(rows)
        guess = {"instruction": pcol, **({"output": acol} if acol else {})}
    except DatasetError:
        pass
    return {"columns": columns, "roles": MAPPING_ROLES, "mapping": current or guess,
            "prompts_hint": hint and not current}


def set_column_mapping(engine: Engine, settings: Settings, actor: User, dataset_id: str,
                       mapping: dict[str, str] | None) -> Dataset:
    """Read the dataset's columns as alpaca fields (``{role: column}``; None or all-empty
    clears it) and validate it again with that mapping (a new ``validate_dataset`` job; the
    dataset is ``validating`` meanwhile). The preview and every run on it then use the mapping.

    Raises:
        StudioError: not_found (unknown or another user's dataset); conflict while it is still
            validating or when it is a GRPO prompt dataset; invalid (field: the role) for a
            mapping without an instruction or output column, a column named twice, or a column
            the file does not have.
    """
    from app.data.formats import check_column_mapping

    ds = validation.check_stale(engine, access.dataset(engine, actor, dataset_id))
    if ds.status == validation.VALIDATING:
        raise StudioError("conflict", f"dataset {ds.filename!r} is {validation.progress_text(ds)}",
                          "file_id")
    if uploaded_for_grpo(ds):
        raise StudioError("conflict", f"dataset {ds.filename!r} is a GRPO prompt dataset; its "
                          "prompt and answer columns are chosen on the GRPO run form", "file_id")
    try:
        clean = check_column_mapping(mapping, file_columns(ds.path))
    except DatasetError as exc:
        raise invalid(exc.field or "column_mapping", exc.message) from None
    ds = validation.restart(engine, ds, {"mode": "sft", "column_mapping": clean})
    audit.record(engine, actor.id, "dataset.columns_mapped", "dataset", ds.id, mapping=clean)
    return ds
