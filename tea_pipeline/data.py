"""Loading a pair of temporal knowledge graphs (TKGs) in the TEA-GNN / LightTEA folder layout, through `datasets`.

Folder layout (tab separated, no header, CRLF or LF, no quoting):
``ent_ids_1/2`` (id, name), ``rel_ids_1/2`` (id, name or name, id), ``triples_1/2`` (h, r, t, tau) or
(h, r, t, tau_begin, tau_end), ``time_id`` (id, label; optional), ``sup_pairs`` and ``ref_pairs`` (kg1 id, kg2 id).
Every file is read with the `datasets` ``text`` builder, so a second load comes from the Arrow cache, and parsed with
vectorised pyarrow kernels; any malformed row is reported as ``file:line``.

The same tables are accepted as a `datasets.DatasetDict` (or a folder of ``<table>.parquet`` files) with the tables
of `TKGPair.to_dataset_dict`: ``facts`` {kg, head, relation, tail, time_begin, time_end (-1 when the fact has one
time stamp)}, ``entities`` {id, kg, name}, ``relations`` {id, kg, name}, ``times`` {id, label}, ``alignment``
{ent1, ent2} (sup_pairs then ref_pairs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

TEXT_FILES = ("ent_ids_1", "ent_ids_2", "rel_ids_1", "rel_ids_2", "triples_1", "triples_2", "sup_pairs",
              "ref_pairs")
OPTIONAL_TEXT_FILES = ("time_id",)
TABLES = ("facts", "entities", "relations", "times", "alignment")
UNKNOWN_TIME_LABELS = ("-inf", "unknown", "none", "nan", "")


class TKGDataError(ValueError):
    """Malformed or inconsistent TKG-pair data; the message names the file (and line) and the fix."""


@dataclass
class TKGPair:
    """Two temporal KGs sharing one entity-id space, with their reference alignment.

    ``facts`` is an ``(F, 6)`` int64 array ``kg, head, relation, tail, time_begin, time_end`` (``time_end = -1``
    for a fact with a single time stamp, as in ICEWS). ``pairs`` holds every aligned pair in sup_pairs-then-ref_pairs
    order; the first ``num_seeds`` rows are the seeds and the rest is the test set.
    """

    name: str
    num_entities: int
    kg1_entities: np.ndarray
    kg2_entities: np.ndarray
    entity_names: list[str]
    relation_names: list[str]
    time_labels: list[str]
    facts: np.ndarray
    pairs: np.ndarray
    num_seeds: int
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def seeds(self) -> np.ndarray:
        return self.pairs[: self.num_seeds]

    @property
    def test(self) -> np.ndarray:
        return self.pairs[self.num_seeds:]

    @property
    def num_relations(self) -> int:
        return len(self.relation_names)

    @property
    def num_times(self) -> int:
        return len(self.time_labels)

    @property
    def detected_unknown_time_id(self) -> int | None:
        """Time id 0 when its label says "unknown" (YAGO-WIKI's ``-inf``), else ``None`` (ICEWS: a real day)."""
        if self.time_labels and self.time_labels[0].strip().lower() in UNKNOWN_TIME_LABELS:
            return 0
        return None

    def with_seeds(self, num_seeds: int) -> TKGPair:
        """The same pair with another seed count (validated like `load_tkg_pair`)."""
        _check_num_seeds(num_seeds, len(self.pairs), self.sources.get("alignment", "alignment"))
        return TKGPair(**{**self.__dict__, "num_seeds": int(num_seeds)})

    def summary(self) -> dict[str, int]:
        return {"entities": self.num_entities, "kg1_entities": len(self.kg1_entities),
                "kg2_entities": len(self.kg2_entities), "relations": self.num_relations, "times": self.num_times,
                "facts_kg1": int((self.facts[:, 0] == 1).sum()), "facts_kg2": int((self.facts[:, 0] == 2).sum()),
                "pairs": len(self.pairs), "seeds": self.num_seeds, "test": len(self.pairs) - self.num_seeds}

    def to_dataset_dict(self):
        """The pair as a `datasets.DatasetDict` with the tables ``facts``, ``entities``, ``relations``, ``times``,
        ``alignment`` (the layout `load_tkg_pair` also accepts)."""
        from datasets import Dataset, DatasetDict  # noqa: PLC0415  (datasets is slow to import)

        kg_of = np.zeros(self.num_entities, dtype=np.int8)
        kg_of[self.kg1_entities] = 1
        kg_of[self.kg2_entities] = 2
        ent_ids = np.concatenate([self.kg1_entities, self.kg2_entities])
        rel_kg = np.ones(self.num_relations, dtype=np.int8)
        rel_kg[sorted({int(r) for r in self.facts[self.facts[:, 0] == 2, 2]})] = 2
        tables = {
            "facts": {"kg": self.facts[:, 0].astype(np.int8), "head": self.facts[:, 1],
                      "relation": self.facts[:, 2], "tail": self.facts[:, 3], "time_begin": self.facts[:, 4],
                      "time_end": self.facts[:, 5]},
            "entities": {"id": ent_ids, "kg": kg_of[ent_ids], "name": [self.entity_names[i] for i in ent_ids]},
            "relations": {"id": np.arange(self.num_relations), "kg": rel_kg, "name": list(self.relation_names)},
            "times": {"id": np.arange(self.num_times), "label": list(self.time_labels)},
            "alignment": {"ent1": self.pairs[:, 0], "ent2": self.pairs[:, 1]},
        }
        return DatasetDict({k: Dataset.from_dict(v) for k, v in tables.items()})

    def save_text(self, folder: str | Path, num_sup: int | None = None) -> Path:
        """Write the TEA-GNN text layout (``triples_*`` get 4 columns when no fact has an end time, else 5);
        the first ``num_sup`` pairs (default: the seeds) go to ``sup_pairs``, the rest to ``ref_pairs``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        num_sup = self.num_seeds if num_sup is None else num_sup
        five = bool((self.facts[:, 5] >= 0).any())

        def write(name: str, lines) -> None:
            (folder / name).write_text("".join(line + "\n" for line in lines))

        for kg, ents in ((1, self.kg1_entities), (2, self.kg2_entities)):
            write(f"ent_ids_{kg}", (f"{e}\t{self.entity_names[e]}" for e in ents.tolist()))
            rels = sorted({int(r) for r in self.facts[self.facts[:, 0] == kg, 2]})
            write(f"rel_ids_{kg}", (f"{r}\t{self.relation_names[r]}" for r in rels))
            f = self.facts[self.facts[:, 0] == kg][:, 1:6 if five else 5]
            write(f"triples_{kg}", ("\t".join(map(str, row)) for row in f.tolist()))
        write("time_id", (f"{i}\t{label}" for i, label in enumerate(self.time_labels)))
        write("sup_pairs", (f"{a}\t{b}" for a, b in self.pairs[:num_sup].tolist()))
        write("ref_pairs", (f"{a}\t{b}" for a, b in self.pairs[num_sup:].tolist()))
        return folder

    def save_parquet(self, folder: str | Path) -> Path:
        """Write every table as ``<folder>/<table>.parquet``; `load_tkg_pair(folder, n)` reads it back."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for name, ds in self.to_dataset_dict().items():
            ds.to_parquet(str(folder / f"{name}.parquet"))
        return folder


def load_tkg_pair(source: Any, num_seeds: int, *, cache_dir: str | Path | None = None,
                  name: str | None = None) -> TKGPair:
    """Load a TKG pair and split its alignment into ``num_seeds`` seeds and a test set.

    Args:
        source: a folder in the TEA-GNN/LightTEA text layout, a folder of ``<table>.parquet`` files, or a
            `datasets.DatasetDict` with the tables of `TKGPair.to_dataset_dict`.
        num_seeds: seeds are the first ``num_seeds`` pairs of sup_pairs followed by ref_pairs (the TEA-GNN rule);
            the remaining pairs are the test set.
        cache_dir: `datasets` cache folder for the Arrow copies (default: the Hugging Face cache).
        name: a display name (default: the folder name).

    Raises:
        TKGDataError: naming the file and line of a missing file, a row with the wrong column count, a non-integer
            or out-of-range id, a pair naming an entity of the wrong graph, or more seeds than pairs.

    Example:
    ```python
    >>> from tea_pipeline import load_tkg_pair
    >>> pair = load_tkg_pair("../shared/data/tea/YAGO-WIKI20K", num_seeds=400)
    >>> pair.summary()["test"]
    19062
    ```
    """
    if hasattr(source, "keys") and not isinstance(source, (str, Path)):
        return _from_tables({k: source[k].data.table for k in source.keys()}, num_seeds,
                            name or "dataset", {k: f"table '{k}'" for k in TABLES})
    folder = Path(source)
    if not folder.is_dir():
        raise TKGDataError(f"{folder}: no such folder. Pass the folder that holds ent_ids_1, triples_1, sup_pairs, "
                           "... (TEA-GNN layout) or the <table>.parquet files of TKGPair.save_parquet.")
    if (folder / "facts.parquet").exists():
        return _from_parquet(folder, num_seeds, name or folder.name)
    return _from_text_folder(folder, num_seeds, cache_dir, name or folder.name)


# ---------------------------------------------------------------------------------------------------------------
# text folder


def _from_text_folder(folder: Path, num_seeds: int, cache_dir: str | Path | None, name: str) -> TKGPair:
    missing = [f for f in TEXT_FILES if not (folder / f).is_file()]
    if missing:
        hint = ""
        if set(missing) <= {"triples_1", "triples_2"}:
            hint = (" The DICEWS (ICEWS05-15) and YAGO-WIKI50K fact files are not shipped in shared/data/tea; "
                    "see its SOURCE.md for where to get them (soledad921/TEA-GNN:data/<dataset>/triples_{1,2}).")
        raise TKGDataError(f"{folder}: missing file(s) {', '.join(missing)}. A TKG pair folder needs "
                           f"{', '.join(TEXT_FILES)} (and optionally time_id); add the missing file(s)." + hint)
    files = {f: folder / f for f in TEXT_FILES + OPTIONAL_TEXT_FILES if (folder / f).is_file()}
    from datasets import load_dataset  # noqa: PLC0415  (datasets is slow to import)

    raw = load_dataset("text", data_files={k: str(v) for k, v in files.items()},
                       cache_dir=None if cache_dir is None else str(cache_dir))
    rows = {k: _Rows(raw[k].data.table.column("text"), str(files[k])) for k in files}

    ent1 = rows["ent_ids_1"].columns(2, split_max=1, int_cols=(0,))
    ent2 = rows["ent_ids_2"].columns(2, split_max=1, int_cols=(0,))
    rel1 = rows["rel_ids_1"].id_name_any_order()
    rel2 = rows["rel_ids_2"].id_name_any_order()
    tri1 = rows["triples_1"].int_matrix((4, 5))
    tri2 = rows["triples_2"].int_matrix((4, 5))
    sup = rows["sup_pairs"].int_matrix((2,))
    ref = rows["ref_pairs"].int_matrix((2,))
    times = rows["time_id"].columns(2, split_max=1, int_cols=(0,)) if "time_id" in rows else None

    ent_ids = {1: ent1[0], 2: ent2[0]}
    num_entities = int(max(ent1[0].max(initial=-1), ent2[0].max(initial=-1))) + 1
    names = [""] * num_entities
    for ids, labels in (ent1, ent2):
        for i, n in zip(ids.tolist(), labels):
            names[i] = n
    overlap = np.intersect1d(ent1[0], ent2[0])
    if len(overlap):
        raise TKGDataError(f"{files['ent_ids_2']}: entity id {int(overlap[0])} also appears in ent_ids_1; the two "
                           "graphs must use disjoint ids (KG2 ids follow KG1 ids). Renumber one graph.")
    num_relations = int(max(rel1[0].max(initial=-1), rel2[0].max(initial=-1))) + 1
    rel_names = [""] * num_relations
    for ids, labels in (rel1, rel2):
        for i, n in zip(ids.tolist(), labels):
            rel_names[i] = n
    if times is not None:
        num_times = int(times[0].max(initial=-1)) + 1
        time_labels = [""] * num_times
        for i, n in zip(times[0].tolist(), times[1]):
            time_labels[i] = n.strip()
    else:
        num_times = int(max(tri1[:, 3:].max(initial=0), tri2[:, 3:].max(initial=0))) + 1
        time_labels = [str(i) for i in range(num_times)]

    facts = []
    for kg, tri, key in ((1, tri1, "triples_1"), (2, tri2, "triples_2")):
        _check_range(tri[:, 0], num_entities, files[key], "head entity id", "ent_ids_1/ent_ids_2")
        _check_range(tri[:, 2], num_entities, files[key], "tail entity id", "ent_ids_1/ent_ids_2")
        _check_range(tri[:, 1], num_relations, files[key], "relation id", "rel_ids_1/rel_ids_2")
        _check_range(tri[:, 3:], num_times, files[key], "time id", "time_id")
        f = np.full((len(tri), 6), -1, dtype=np.int64)
        f[:, 0] = kg
        f[:, 1:1 + tri.shape[1]] = tri
        facts.append(f)
    facts = np.concatenate(facts)
    pairs = np.concatenate([sup, ref]).astype(np.int64)
    line_of = [(files["sup_pairs"], i + 1) for i in rows["sup_pairs"].kept] + \
              [(files["ref_pairs"], i + 1) for i in rows["ref_pairs"].kept]
    _check_pairs(pairs, ent_ids, num_entities, lambda r: f"{line_of[r][0]}:{line_of[r][1]}")
    _check_num_seeds(num_seeds, len(pairs), f"{files['sup_pairs']} + {files['ref_pairs']}")
    return TKGPair(name=name, num_entities=num_entities, kg1_entities=np.sort(ent1[0]),
                   kg2_entities=np.sort(ent2[0]), entity_names=names, relation_names=rel_names,
                   time_labels=time_labels, facts=facts, pairs=pairs, num_seeds=int(num_seeds),
                   sources={k: str(v) for k, v in files.items()} | {"alignment": "sup_pairs + ref_pairs"})


class _Rows:
    """The non-empty lines of one text file, parsed with vectorised pyarrow kernels; errors name ``file:line``."""

    def __init__(self, column: pa.ChunkedArray, path: str) -> None:
        text = pc.utf8_rtrim(column.combine_chunks(), characters="\r\n")
        keep = pc.not_equal(pc.utf8_length(pc.utf8_trim_whitespace(text)), 0)
        self.kept = np.flatnonzero(keep.to_numpy(zero_copy_only=False))
        self.text = pc.filter(text, keep)
        self.path = path

    def _where(self, row: int) -> str:
        return f"{self.path}:{int(self.kept[row]) + 1}"

    def _split(self, ncols: tuple[int, ...], split_max: int | None) -> tuple[pa.Array, int]:
        parts = pc.split_pattern(self.text, "\t", max_splits=split_max)
        lens = pc.list_value_length(parts).to_numpy(zero_copy_only=False)
        if len(lens) == 0:
            raise TKGDataError(f"{self.path}: the file is empty; it needs one tab-separated record per line.")
        width = int(lens[0]) if int(lens[0]) in ncols else ncols[0]
        bad = np.flatnonzero(lens != width)
        if len(bad):
            r = int(bad[0])
            expect = " or ".join(map(str, ncols)) if int(lens[0]) not in ncols else str(width)
            raise TKGDataError(f"{self._where(r)}: expected {expect} tab-separated columns, found {int(lens[r])} "
                               f"({self.text[r].as_py()!r}). Fix or remove that line (fields are separated by "
                               "single TABs, no quoting).")
        return parts, width

    def _to_int(self, flat: pa.Array, width: int, col_offset: int = 0) -> np.ndarray:
        trimmed = pc.utf8_trim_whitespace(flat)
        try:
            return pc.cast(trimmed, pa.int64()).to_numpy(zero_copy_only=False)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            values = trimmed.to_pylist()
            for i, v in enumerate(values):
                try:
                    int(v)
                except (TypeError, ValueError):
                    raise TKGDataError(f"{self._where(i // width)}: column {i % width + 1 + col_offset} is "
                                       f"{v!r}, not an integer id. Fix that line.") from None
            raise

    def int_matrix(self, ncols: tuple[int, ...]) -> np.ndarray:
        parts, width = self._split(ncols, None)
        return self._to_int(pc.list_flatten(parts), width).reshape(-1, width)

    def columns(self, ncols: int, split_max: int, int_cols: tuple[int, ...]) -> tuple[np.ndarray, list[str]]:
        parts, width = self._split((ncols,), split_max)
        ids = self._to_int(pc.list_element(parts, int_cols[0]), 1, int_cols[0])
        return ids, pc.list_element(parts, 1 - int_cols[0]).to_pylist()

    def id_name_any_order(self) -> tuple[np.ndarray, list[str]]:
        """``rel_ids`` is ``id, name`` in YAGO-WIKI but ``name, id`` in ICEWS05-15: use the all-integer column."""
        parts, _ = self._split((2,), None)
        for id_col in (0, 1):
            col = pc.utf8_trim_whitespace(pc.list_element(parts, id_col))
            if pc.all(pc.utf8_is_numeric(col)).as_py():
                ids = pc.cast(col, pa.int64()).to_numpy(zero_copy_only=False)
                return ids, pc.list_element(parts, 1 - id_col).to_pylist()
        first = pc.list_element(parts, 0).to_pylist()
        bad = next(i for i, v in enumerate(first) if not v.strip().isdigit())
        raise TKGDataError(f"{self._where(bad)}: neither column is an integer relation id "
                           f"({self.text[bad].as_py()!r}). rel_ids lines are 'id<TAB>name' or 'name<TAB>id'.")


# ---------------------------------------------------------------------------------------------------------------
# tables (DatasetDict / parquet)


def _from_parquet(folder: Path, num_seeds: int, name: str) -> TKGPair:
    from datasets import load_dataset  # noqa: PLC0415

    files = {t: folder / f"{t}.parquet" for t in TABLES}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise TKGDataError(f"{folder}: missing table file(s) {', '.join(missing)}; a parquet TKG pair needs "
                           f"{', '.join(t + '.parquet' for t in TABLES)} (written by TKGPair.save_parquet).")
    # one load per table: the parquet builder infers a single schema for all splits of one call
    tables = {k: load_dataset("parquet", data_files=str(v), split="train").data.table for k, v in files.items()}
    return _from_tables(tables, num_seeds, name, {k: str(v) for k, v in files.items()})


_TABLE_COLUMNS = {"facts": ("kg", "head", "relation", "tail", "time_begin", "time_end"),
                  "entities": ("id", "kg", "name"), "relations": ("id", "name"), "times": ("id", "label"),
                  "alignment": ("ent1", "ent2")}


def _from_tables(tables: dict[str, pa.Table], num_seeds: int, name: str, where: dict[str, str]) -> TKGPair:
    for t, cols in _TABLE_COLUMNS.items():
        if t not in tables:
            raise TKGDataError(f"{name}: table '{t}' is missing; expected tables {list(TABLES)} "
                               "(see TKGPair.to_dataset_dict).")
        lacking = [c for c in cols if c not in tables[t].column_names]
        if lacking:
            raise TKGDataError(f"{where[t]}: columns {lacking} are missing; table '{t}' needs {list(cols)}.")

    def ints(t: str, c: str) -> np.ndarray:
        return np.asarray(tables[t].column(c).to_numpy(), dtype=np.int64)

    ent_id, ent_kg = ints("entities", "id"), ints("entities", "kg")
    num_entities = int(ent_id.max(initial=-1)) + 1
    names = [""] * num_entities
    for i, n in zip(ent_id.tolist(), tables["entities"].column("name").to_pylist()):
        names[i] = n
    rel_id = ints("relations", "id")
    rel_names = [""] * (int(rel_id.max(initial=-1)) + 1)
    for i, n in zip(rel_id.tolist(), tables["relations"].column("name").to_pylist()):
        rel_names[i] = n
    time_id = ints("times", "id")
    time_labels = [""] * (int(time_id.max(initial=-1)) + 1)
    for i, n in zip(time_id.tolist(), tables["times"].column("label").to_pylist()):
        time_labels[i] = str(n)
    facts = np.stack([ints("facts", c) for c in _TABLE_COLUMNS["facts"]], axis=1)
    bad_kg = np.flatnonzero(~np.isin(facts[:, 0], (1, 2)))
    if len(bad_kg):
        raise TKGDataError(f"{where['facts']}, row {int(bad_kg[0])}: kg is {int(facts[bad_kg[0], 0])}; use 1 or 2.")
    _check_range(facts[:, [1, 3]], num_entities, where["facts"], "entity id", "the entities table", rows_are="row")
    _check_range(facts[:, 2], len(rel_names), where["facts"], "relation id", "the relations table", rows_are="row")
    times = facts[:, 4:].copy()
    times[:, 1][times[:, 1] == -1] = 0
    _check_range(times, len(time_labels), where["facts"], "time id", "the times table", rows_are="row")
    pairs = np.stack([ints("alignment", "ent1"), ints("alignment", "ent2")], axis=1)
    ent_ids = {1: np.sort(ent_id[ent_kg == 1]), 2: np.sort(ent_id[ent_kg == 2])}
    _check_pairs(pairs, ent_ids, num_entities, lambda r: f"{where['alignment']}, row {r}")
    _check_num_seeds(num_seeds, len(pairs), where["alignment"])
    return TKGPair(name=name, num_entities=num_entities, kg1_entities=ent_ids[1], kg2_entities=ent_ids[2],
                   entity_names=names, relation_names=rel_names, time_labels=time_labels, facts=facts,
                   pairs=pairs, num_seeds=int(num_seeds), sources=dict(where))


# ---------------------------------------------------------------------------------------------------------------
# checks


def _check_range(values: np.ndarray, upper: int, path: Any, what: str, defined_in: str,
                 rows_are: str = "line") -> None:
    values = values.reshape(len(values), -1)
    bad = np.flatnonzero(((values < 0) | (values >= upper)).any(axis=1))
    if len(bad):
        r = int(bad[0])
        v = int(values[r][(values[r] < 0) | (values[r] >= upper)][0])
        loc = f"{path}:{r + 1}" if rows_are == "line" else f"{path}, row {r}"
        raise TKGDataError(f"{loc}: {what} {v} is out of range [0, {upper}) defined by {defined_in}. "
                           f"Fix the id or add it to {defined_in}.")


def _check_pairs(pairs: np.ndarray, ent_ids: dict[int, np.ndarray], num_entities: int, where) -> None:
    for side, kg in ((0, 1), (1, 2)):
        known = np.zeros(num_entities + 1, dtype=bool)
        known[ent_ids[kg]] = True
        ids = np.where((pairs[:, side] >= 0) & (pairs[:, side] < num_entities), pairs[:, side], num_entities)
        bad = np.flatnonzero(~known[ids])
        if len(bad):
            r = int(bad[0])
            raise TKGDataError(f"{where(r)}: pair ({int(pairs[r, 0])}, {int(pairs[r, 1])}) names entity "
                               f"{int(pairs[r, side])}, which is not an entity of KG{kg} (ent_ids_{kg}). "
                               f"Pairs are 'kg1_id<TAB>kg2_id'; fix the pair or add the entity.")


def _check_num_seeds(num_seeds: Any, num_pairs: int, where: str) -> None:
    if not isinstance(num_seeds, (int, np.integer)) or isinstance(num_seeds, bool) or num_seeds < 0:
        raise TKGDataError(f"num_seeds={num_seeds!r} is invalid: it must be a non-negative integer.")
    if num_seeds >= num_pairs:
        raise TKGDataError(f"num_seeds={num_seeds} is too large: {where} hold only {num_pairs} aligned pairs, "
                           f"and at least one must remain for the test set. Use num_seeds < {num_pairs}.")
