"""tea_pipeline loading: the TEA-GNN text layout (CRLF, column orders, 4/5 columns), parquet/datasets tables,
errors that name the file and line, and the shared benchmark folders when present."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tea_pipeline import TKGDataError, TKGPair, load_tkg_pair, make_synthetic_pair

SHARED_TEA = Path(os.environ.get("HF_SCALE_SHARED_DATA", Path(__file__).resolve().parents[2].parent / "shared" /
                                 "data")) / "tea"


@pytest.fixture(scope="module")
def pair() -> TKGPair:
    return make_synthetic_pair(num_entities=60, num_relations=4, num_times=12, seed=1)


@pytest.fixture()
def folder(tmp_path: Path, pair: TKGPair) -> Path:
    return pair.save_text(tmp_path / "pair", num_sup=10)


def _load(folder: Path, seeds: int, tmp_path: Path) -> TKGPair:
    return load_tkg_pair(folder, seeds, cache_dir=tmp_path / "cache")


def _same(a: TKGPair, b: TKGPair) -> None:
    assert a.num_entities == b.num_entities and a.num_seeds == b.num_seeds
    assert np.array_equal(a.facts, b.facts) and np.array_equal(a.pairs, b.pairs)
    assert a.entity_names == b.entity_names and a.time_labels == b.time_labels
    assert np.array_equal(a.kg1_entities, b.kg1_entities) and np.array_equal(a.kg2_entities, b.kg2_entities)


def test_text_round_trip_and_seed_split(folder: Path, pair: TKGPair, tmp_path: Path) -> None:
    loaded = _load(folder, 15, tmp_path)
    _same(loaded, pair.with_seeds(15))
    assert np.array_equal(loaded.seeds, pair.pairs[:15]) and np.array_equal(loaded.test, pair.pairs[15:])
    assert loaded.detected_unknown_time_id == 0


def test_crlf_name_first_relations_and_four_columns(folder: Path, pair: TKGPair, tmp_path: Path) -> None:
    # ICEWS05-15 style: CRLF endings, rel_ids as "name<TAB>id", one time stamp per fact, no unknown time label
    for name in ("rel_ids_1", "rel_ids_2"):
        rows = [line.split("\t") for line in (folder / name).read_text().splitlines()]
        (folder / name).write_bytes("".join(f"{n}\t{i}\r\n" for i, n in rows).encode())
    for name in ("triples_1", "triples_2", "sup_pairs", "ref_pairs"):
        lines = (folder / name).read_text().splitlines()
        if name.startswith("triples"):
            lines = ["\t".join(line.split("\t")[:4]) for line in lines]
        (folder / name).write_bytes(("\r\n".join(lines) + "\r\n\r\n").encode())
    (folder / "time_id").write_text("".join(f"{i}\t2005-01-{i + 1:02d}\n" for i in range(pair.num_times)))
    loaded = _load(folder, 10, tmp_path)
    assert np.array_equal(loaded.facts[:, :5], pair.facts[:, :5]) and (loaded.facts[:, 5] == -1).all()
    assert np.array_equal(loaded.pairs, pair.pairs)
    assert loaded.relation_names == pair.relation_names
    assert loaded.detected_unknown_time_id is None


def test_parquet_and_dataset_dict_round_trip(pair: TKGPair, tmp_path: Path) -> None:
    _same(load_tkg_pair(pair.to_dataset_dict(), pair.num_seeds), pair)
    _same(load_tkg_pair(pair.save_parquet(tmp_path / "pq"), pair.num_seeds), pair)


# --------------------------------------------------------------------------------------------- bad input


def _edit_line(path: Path, line: int, new: str) -> None:
    lines = path.read_text().splitlines()
    lines[line - 1] = new
    path.write_text("\n".join(lines) + "\n")


def test_missing_file_is_named(folder: Path, tmp_path: Path) -> None:
    (folder / "triples_2").unlink()
    with pytest.raises(TKGDataError, match=r"missing file\(s\) triples_2.*SOURCE.md"):
        _load(folder, 10, tmp_path)
    with pytest.raises(TKGDataError, match="no such folder"):
        _load(tmp_path / "nowhere", 10, tmp_path)


def test_wrong_column_count_names_file_and_line(folder: Path, tmp_path: Path) -> None:
    _edit_line(folder / "triples_1", 3, "1\t2\t3")
    with pytest.raises(TKGDataError, match=r"triples_1:3: expected 5 tab-separated columns, found 3"):
        _load(folder, 10, tmp_path)


def test_non_integer_id_names_file_and_line(folder: Path, tmp_path: Path) -> None:
    _edit_line(folder / "ref_pairs", 4, "7\tabc")
    with pytest.raises(TKGDataError, match=r"ref_pairs:4: column 2 is 'abc', not an integer"):
        _load(folder, 10, tmp_path)


def test_id_out_of_range_names_file_and_line(folder: Path, tmp_path: Path) -> None:
    _edit_line(folder / "triples_2", 5, "5\t4\t99999\t1\t2")
    with pytest.raises(TKGDataError, match=r"triples_2:5: tail entity id 99999 is out of range \[0, 120\)"):
        _load(folder, 10, tmp_path)
    _edit_line(folder / "triples_2", 5, "61\t4\t70\t1\t500")
    with pytest.raises(TKGDataError, match=r"triples_2:5: time id 500 is out of range"):
        _load(folder, 10, tmp_path)


def test_seed_pair_with_unknown_entity_names_file_and_line(folder: Path, tmp_path: Path) -> None:
    _edit_line(folder / "sup_pairs", 2, "70\t80")  # 70 is a KG2 entity, not a KG1 one
    with pytest.raises(TKGDataError, match=r"sup_pairs:2: pair \(70, 80\) names entity 70, which is not an entity "
                                           r"of KG1"):
        _load(folder, 10, tmp_path)


def test_more_seeds_than_pairs(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(TKGDataError, match=r"num_seeds=60 is too large: .*sup_pairs \+ .*ref_pairs hold only 60"):
        _load(folder, 60, tmp_path)
    with pytest.raises(TKGDataError, match="non-negative"):
        _load(folder, -1, tmp_path)


# ------------------------------------------------------------------------------------------ shared data


@pytest.mark.shared_data
def test_shared_toy_set_and_missing_fact_files(tmp_path: Path) -> None:
    if not (SHARED_TEA / "testdata").is_dir():
        pytest.skip(f"shared TEA data not found at {SHARED_TEA} (set HF_SCALE_SHARED_DATA)")
    toy = _load(SHARED_TEA / "testdata", 20, tmp_path)
    assert toy.summary()["pairs"] == 122 and toy.time_labels[0] == "-inf"
    for name in ("ICEWS05-15", "YAGO-WIKI50K"):
        if (SHARED_TEA / name / "triples_1").exists():
            continue  # the fact files were added: nothing to check here
        with pytest.raises(TKGDataError, match="missing file"):
            _load(SHARED_TEA / name, 1000, tmp_path)


@pytest.mark.shared_data
def test_shared_icews_relation_files_parse_name_first(tmp_path: Path) -> None:
    icews = SHARED_TEA / "ICEWS05-15"
    if not icews.is_dir():
        pytest.skip(f"shared TEA data not found at {SHARED_TEA} (set HF_SCALE_SHARED_DATA)")
    # Copy the real CRLF, name-first files and add tiny stand-in fact files (the real ones are not shipped).
    work = tmp_path / "icews"
    work.mkdir()
    for f in icews.iterdir():
        (work / f.name).write_bytes(f.read_bytes())
    for kg, (h, t) in ((1, (0, 5)), (2, (9517, 9520))):
        if not (work / f"triples_{kg}").exists():
            (work / f"triples_{kg}").write_text(f"{h}\t{3 if kg == 1 else 300}\t{t}\t3603\n")
    loaded = _load(work, 1000, tmp_path)
    assert loaded.summary()["pairs"] == 8566 and loaded.summary()["test"] == 7566
    assert loaded.relation_names[0] == "Mediate" and loaded.detected_unknown_time_id is None
    assert loaded.time_labels[0] == "2005-01-01"
