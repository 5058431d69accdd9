"""Synthetic TKG pairs with a known alignment: two noisy views of one random temporal graph (for tests and demos)."""

from __future__ import annotations

import numpy as np

from .data import TKGPair


def make_synthetic_pair(num_entities: int = 1000, num_relations: int = 12, num_times: int = 60,
                        facts_per_entity: float = 6.0, keep_prob: float = 0.8, unknown_time_prob: float = 0.2,
                        seed_fraction: float = 0.2, seed: int = 0) -> TKGPair:
    """Build one random temporal graph and derive two KGs from it.

    Each KG keeps every fact with probability ``keep_prob`` (independently), gets its own entity-id permutation
    (KG2 ids follow KG1 ids), its own relation ids, and loses a time stamp to "unknown" (time id 0, labelled
    ``-inf`` as in YAGO-WIKI) with probability ``unknown_time_prob``. Facts have a begin and an end time (5-column
    layout). All ``num_entities`` entities are aligned; the pairs come in random order and the first
    ``round(seed_fraction * num_entities)`` are the seeds.
    """
    if num_entities < 10:
        raise ValueError(f"num_entities={num_entities} is too small: use at least 10.")
    if not 0.0 < keep_prob <= 1.0 or not 0.0 <= unknown_time_prob < 1.0 or not 0.0 < seed_fraction < 1.0:
        raise ValueError("keep_prob must be in (0, 1], unknown_time_prob in [0, 1), seed_fraction in (0, 1).")
    rng = np.random.default_rng(seed)
    n = num_entities
    num_facts = int(facts_per_entity * n)
    # Skewed degrees, like real KGs: heads drawn from a Zipf-like distribution, every entity appears at least once.
    weights = 1.0 / np.arange(1, n + 1) ** 0.6
    weights /= weights.sum()
    heads = np.concatenate([np.arange(n), rng.choice(n, num_facts - n, p=weights)])
    tails = rng.choice(n, num_facts, p=weights)
    loop = heads == tails
    tails[loop] = (tails[loop] + 1) % n
    rels = rng.integers(0, num_relations, num_facts)
    begin = rng.integers(1, num_times, num_facts)
    end = np.minimum(begin + rng.integers(0, 5, num_facts), num_times - 1)

    kg_perm = [rng.permutation(n), n + rng.permutation(n)]
    facts = []
    for kg in (0, 1):
        keep = rng.random(num_facts) < keep_prob
        tb, te = begin[keep].copy(), end[keep].copy()
        tb[rng.random(len(tb)) < unknown_time_prob] = 0
        te[rng.random(len(te)) < unknown_time_prob] = 0
        f = np.stack([np.full(keep.sum(), kg + 1), kg_perm[kg][heads[keep]], rels[keep] + kg * num_relations,
                      kg_perm[kg][tails[keep]], tb, te], axis=1)
        facts.append(f)
    order = rng.permutation(n)
    pairs = np.stack([kg_perm[0][order], kg_perm[1][order]], axis=1).astype(np.int64)
    names = [""] * (2 * n)
    for i in range(n):
        names[kg_perm[0][i]] = f"kg1:entity_{i}"
        names[kg_perm[1][i]] = f"kg2:entity_{i}"
    return TKGPair(
        name=f"synthetic-{n}-seed{seed}",
        num_entities=2 * n,
        kg1_entities=np.arange(n),
        kg2_entities=np.arange(n, 2 * n),
        entity_names=names,
        relation_names=[f"kg1:rel_{r}" for r in range(num_relations)] + [f"kg2:rel_{r}" for r in
                                                                           range(num_relations)],
        time_labels=["-inf"] + [str(1900 + t) for t in range(1, num_times)],
        facts=np.concatenate(facts).astype(np.int64),
        pairs=pairs,
        num_seeds=int(round(seed_fraction * n)),
        sources={"alignment": "synthetic"},
    )
