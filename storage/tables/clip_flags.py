"""What ``token_stats`` derives from its stored log-probs: the ratios r8 and r16, and the clip flags.

r = exp(clamp(logp − old_logp, −20, 20)) (docs/method.md) is computed, never
stored: in SQL by the catalog (:func:`ratio_sql`, a derived column of the
view) and in arrow by the writer (:func:`fill_clip_flags`), which stores the
four clip flags when the trainer did not pass them.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc


def ratio_sql(logp: str, old_logp: str) -> str:
    # CASE with FLOAT literals, not least/greatest: those are ~7x slower in DuckDB
    # and skip NULLs (least(NULL, 20) = 20). A NULL difference falls to ELSE: NULL.
    d = f"({logp} - {old_logp})"
    return f"exp(CASE WHEN {d} > 20::FLOAT THEN 20::FLOAT WHEN {d} < -20::FLOAT THEN -20::FLOAT ELSE {d} END)::FLOAT"


def _ratio(logp: pa.ChunkedArray, old_logp: pa.ChunkedArray) -> pa.ChunkedArray:
    """float32 r = exp(clamp(logp − old_logp, −20, 20)); NULL where an input is NULL."""
    d = pc.subtract(logp, old_logp)
    lim = pa.scalar(20.0, pa.float32())
    d = pc.max_element_wise(pc.min_element_wise(d, lim, skip_nulls=False), pc.negate(lim), skip_nulls=False)
    return pc.exp(d)


def fill_clip_flags(t: pa.Table) -> pa.Table:
    """Compute token_stats' clip flags that the writer was not given (docs/method.md, "Clip metrics").

    clipped_lower = A<0 ∧ r8<L, clipped_upper = A>0 ∧ r8>H; the bf16 ones use
    r16 and the standard bounds. NULL propagates (no shadow pass → NULL), so
    overclipped/underclipped in the view are NULL rather than false there.
    """
    if t.column("clipped_lower").null_count < t.num_rows and t.column("bf16_clipped_lower").null_count < t.num_rows:
        return t  # given by the trainer
    adv = t.column("advantage")
    neg, pos = pc.less(adv, 0), pc.greater(adv, 0)
    for prefix, logp, old, lo, hi in (
        ("", "logp_fp8", "old_logp_fp8", "lower_bound", "upper_bound"),
        ("bf16_", "logp_bf16", "old_logp_bf16", "standard_lower", "standard_upper"),
    ):
        if t.column(f"{prefix}clipped_lower").null_count < t.num_rows:
            continue
        r = _ratio(t.column(logp), t.column(old))
        for name, flag in (
            (f"{prefix}clipped_lower", pc.and_(neg, pc.less(r, t.column(lo)))),
            (f"{prefix}clipped_upper", pc.and_(pos, pc.greater(r, t.column(hi)))),
        ):
            t = t.set_column(t.schema.get_field_index(name), t.schema.field(name), flag)
    return t
