"""Interaction data for meta-learning: MovieLens-100K with the cold-start protocol, and a synthetic task generator.

MovieLens-100K is read from a path the user gives, in either layout that carries the GroupLens data:

* the RecBole "atomic files" (``ml-100k.inter``, ``ml-100k.user``, ``ml-100k.item``; tab-separated with a typed
  ``name:type`` header), as in ``../shared/data/movielens/ml-100k``;
* the original GroupLens files (``u.data`` tab-separated; ``u.user`` and ``u.item`` pipe-separated, latin-1).

Cold-start protocol (MeLU / RecBole-MetaRec style): tasks are users; users with 13-100 ratings are kept; the
``new_user_fraction`` of users whose *first* rating is the latest are the held-out new users; a rating >= 4 is a
positive. Features: the user's age bucket, gender, occupation and zip prefix, the item id and release year (sparse),
the item's 19 genre flags (dense). The user id itself is not a feature, since new users have no trained embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["GENRES", "ColdStartData", "encode_categorical", "load_movielens_100k", "make_synthetic_interactions",
           "movielens_cold_start"]

GENRES = ["unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama",
          "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western"]
SPARSE_COLUMNS = ["item_id", "age", "gender", "occupation", "zip", "release_year"]
AGE_BUCKETS = [18, 25, 35, 45, 50, 56]  # MovieLens-1M buckets: <18, 18-24, ..., 56+


def encode_categorical(values) -> tuple[np.ndarray, list]:
    """Codes ``1..V`` for the sorted distinct values (0 is reserved for unknown/missing); returns (codes, vocab)."""
    arr = np.asarray(values).astype(str)
    vocab = sorted(set(arr.tolist()) - {"", "nan", "None"})
    index = {v: i + 1 for i, v in enumerate(vocab)}
    return np.array([index.get(v, 0) for v in arr], dtype=np.int64), vocab


def _read_atomic(path: Path, stem: str) -> dict[str, list[str]]:
    lines = (path / f"{stem}").read_text(encoding="utf-8").splitlines()
    header = [h.split(":")[0] for h in lines[0].split("\t")]
    cols: dict[str, list[str]] = {h: [] for h in header}
    for line in lines[1:]:
        if not line:
            continue
        parts = line.split("\t")
        parts += [""] * (len(header) - len(parts))
        for h, v in zip(header, parts):
            cols[h].append(v)
    return cols


def _load_atomic(path: Path):
    inter = _read_atomic(path, "ml-100k.inter")
    user = _read_atomic(path, "ml-100k.user")
    item = _read_atomic(path, "ml-100k.item")
    genres = [[1.0 if g in set(c.split(" ")) else 0.0 for g in GENRES] for c in item["class"]]
    return (np.array(inter["user_id"], np.int64), np.array(inter["item_id"], np.int64),
            np.array(inter["rating"], np.float32), np.array(inter["timestamp"], np.float64),
            {int(u): (a, g, o, z) for u, a, g, o, z in zip(user["user_id"], user["age"], user["gender"],
                                                           user["occupation"], user["zip_code"])},
            {int(i): (y, gs) for i, y, gs in zip(item["item_id"], item["release_year"], genres)})


def _load_grouplens(path: Path):
    data = np.loadtxt(path / "u.data", dtype=np.int64, ndmin=2)
    users = {}
    for line in (path / "u.user").read_text(encoding="latin-1").splitlines():
        if line.strip():
            u, a, g, o, z = line.split("|")[:5]
            users[int(u)] = (a, g, o, z)
    items = {}
    for line in (path / "u.item").read_text(encoding="latin-1").splitlines():
        if line.strip():
            parts = line.split("|")
            date = parts[2]
            items[int(parts[0])] = (date[-4:] if date else "", [float(x) for x in parts[5:24]])
    return data[:, 0], data[:, 1], data[:, 2].astype(np.float32), data[:, 3].astype(np.float64), users, items


def load_movielens_100k(path: str | Path):
    """Flat MovieLens-100K interactions as a `datasets.Dataset` (see `_movielens_arrays` for the columns)."""
    import datasets

    return datasets.Dataset.from_dict(_movielens_arrays(path))


def _movielens_arrays(path: str | Path) -> dict[str, np.ndarray]:
    """Flat MovieLens-100K interactions as a `datasets.Dataset` (one row per rating), from either layout.

    Columns: ``user_id``, ``item_id`` (original ids), ``rating``, ``timestamp``, ``label`` (rating >= 4), the coded
    sparse columns ``age``, ``gender``, ``occupation``, ``zip``, ``release_year`` (0 = unknown), and ``genres``
    (19 floats). ``item_id`` doubles as its own code (ids are 1..1682).
    """
    path = Path(path)
    if (path / "ml-100k.inter").exists():
        u, i, r, t, users, items = _load_atomic(path)
    elif (path / "u.data").exists():
        u, i, r, t, users, items = _load_grouplens(path)
    else:
        raise FileNotFoundError(f"no MovieLens-100K files in {path}: expected the atomic layout (ml-100k.inter, "
                                "ml-100k.user, ml-100k.item) or the GroupLens layout (u.data, u.user, u.item).")
    age_raw = np.array([int(users[x][0]) for x in u])
    age = np.searchsorted(AGE_BUCKETS, age_raw, side="right").astype(np.int64) + 1
    gender, _ = encode_categorical([users[x][1] for x in u])
    occupation, _ = encode_categorical([users[x][2] for x in u])
    zip_prefix, _ = encode_categorical([users[x][3][:1] for x in u])
    year, _ = encode_categorical([items[x][0] for x in i])
    genres = np.array([items[x][1] for x in i], dtype=np.float32)
    return {
        "user_id": u, "item_id": i, "rating": r, "timestamp": t, "label": (r >= 4).astype(np.float32),
        "age": age, "gender": gender, "occupation": occupation, "zip": zip_prefix, "release_year": year,
        "genres": genres,
    }


@dataclass
class ColdStartData:
    """Interactions split by user for cold-start evaluation, plus what a model needs to know about the features."""

    train: object  # datasets.Dataset: warm users
    valid: object  # datasets.Dataset: the newest warm users (for tuning), disjoint from train
    test: object  # datasets.Dataset: held-out new users
    sparse_columns: list[str]
    dense_columns: list[str]
    vocab_sizes: list[int]
    num_dense: int


def movielens_cold_start(path: str | Path, new_user_fraction: float = 0.2, valid_fraction: float = 0.1,
                         min_interactions: int = 13, max_interactions: int = 100) -> ColdStartData:
    """MovieLens-100K split by user: the newest users (by first rating) are held out as new users.

    ``valid_fraction`` of the remaining users (again the newest) form a validation set for tuning, so the test
    users are never looked at while choosing hyper-parameters.
    """
    if not 0 < new_user_fraction < 1 or not 0 <= valid_fraction < 1:
        raise ValueError(f"new_user_fraction={new_user_fraction} must be in (0, 1) and valid_fraction="
                         f"{valid_fraction} in [0, 1).")
    import datasets

    cols = _movielens_arrays(path)
    users, ts = cols["user_id"], cols["timestamp"]
    uniq, counts = np.unique(users, return_counts=True)
    first = np.full(uniq.max() + 1, np.inf)
    np.minimum.at(first, users, ts)
    kept = uniq[(counts >= min_interactions) & (counts <= max_interactions)]
    kept = kept[np.argsort(first[kept], kind="stable")]
    n_test = int(round(len(kept) * new_user_fraction))
    n_valid = int(round((len(kept) - n_test) * valid_fraction))
    train_u = kept[: len(kept) - n_test - n_valid]
    valid_u = kept[len(kept) - n_test - n_valid: len(kept) - n_test]
    test_u = kept[len(kept) - n_test:]

    def subset(us):
        rows = np.flatnonzero(np.isin(users, us))
        return datasets.Dataset.from_dict({k: v[rows] for k, v in cols.items()})

    vocab = [int(cols[c].max()) + 1 for c in SPARSE_COLUMNS]
    return ColdStartData(subset(train_u), subset(valid_u), subset(test_u), list(SPARSE_COLUMNS), ["genres"],
                         vocab, len(GENRES))


def make_synthetic_interactions(num_users: int = 200, num_items: int = 100, min_interactions: int = 20,
                                max_interactions: int = 40, num_categories: int = 8, num_dense: int = 4,
                                latent_dim: int = 4, user_signal: float = 2.5, user_bias: float = 1.5, seed: int = 0,
                                item_seed: int = 0, first_user_id: int = 0):
    """Synthetic click data where each user (task) has its own taste vector.

    ``p(click) = sigmoid(user_signal * <u, v_item> + b_user + b_item + <c, dense>)`` with ``b_user ~ N(0,
    user_bias²)``: the item part is learnable globally, the user part (taste and base rate) only from the user's own
    interactions, so per-task adaptation helps by construction. Returns a
    `datasets.Dataset` with ``user_id``, ``item_id``, ``category`` (sparse), ``dense`` (list), ``label``,
    ``timestamp``; vocab sizes are ``num_items`` and ``num_categories``. Items (the shared "world") come from
    ``item_seed``, users from ``seed``: draw train and new users with the same ``item_seed`` and different ``seed``
    (and ``first_user_id``) to get disjoint users of one world.
    """
    import datasets

    irng = np.random.default_rng(item_seed)
    rng = np.random.default_rng(seed + 1_000_003)
    v = irng.normal(size=(num_items, latent_dim)) / np.sqrt(latent_dim)
    b = irng.normal(scale=0.5, size=num_items)
    cat = irng.integers(0, num_categories, size=num_items)
    c = irng.normal(scale=0.5, size=num_dense)
    rows = {"user_id": [], "item_id": [], "category": [], "dense": [], "label": [], "timestamp": []}
    for user in range(num_users):
        u = rng.normal(size=latent_dim)
        bu = rng.normal(scale=user_bias)
        n = int(rng.integers(min_interactions, max_interactions + 1))
        items = rng.choice(num_items, size=n, replace=n > num_items)
        dense = rng.normal(size=(n, num_dense)).astype(np.float32)
        logit = user_signal * (v[items] @ u) + bu + b[items] + dense @ c
        label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        rows["user_id"].extend([first_user_id + user] * n)
        rows["item_id"].extend(items.tolist())
        rows["category"].extend(cat[items].tolist())
        rows["dense"].extend(dense.tolist())
        rows["label"].extend(label.tolist())
        rows["timestamp"].extend(np.sort(rng.random(n)).tolist())
    return datasets.Dataset.from_dict(rows)
