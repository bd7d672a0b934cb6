"""SecAgg+ primitives: sealed shares bound to their addressees, unbiased quantization, masks."""

from __future__ import annotations

import numpy as np
import pytest

from fedge.secagg.crypto import derive, generate_keypair, seal, shared_secrets, unseal
from fedge.secagg.vectors import prg_mask, quantize


def test_both_sides_derive_one_key_and_a_sealed_share_opens_only_as_addressed() -> None:
    # Prepare: two nodes agree a key from their X25519 pairs
    (sk_a, pk_a), (sk_b, pk_b) = generate_keypair(), generate_keypair()
    key_a = derive(shared_secrets(sk_a, [pk_b])[0], b"share|round 1")
    key_b = derive(shared_secrets(sk_b, [pk_a])[0], b"share|round 1")
    sealed = seal(key_a, b"share of a", b"a->b")
    # Execute / Assert: the addressee opens it; another context, round key or a flipped bit fails
    assert key_a == key_b
    assert unseal(key_b, sealed, b"a->b") == b"share of a"
    with pytest.raises(ValueError, match="does not authenticate"):
        unseal(key_b, sealed, b"a->c")
    with pytest.raises(ValueError, match="does not authenticate"):
        unseal(derive(shared_secrets(sk_b, [pk_a])[0], b"share|round 2"), sealed, b"a->b")
    tampered = sealed[:-1] + bytes([sealed[-1] ^ 1])
    with pytest.raises(ValueError, match="does not authenticate"):
        unseal(key_b, tampered, b"a->b")


def test_stochastic_rounding_is_unbiased() -> None:
    # Prepare: 0.3 of a level above level 5 (levels 10 over [-1, 1]: step 0.2)
    vec = np.full(200_000, -1.0 + 5.3 * 0.2)
    # Execute
    q = quantize(vec, clip=1.0, levels=10, rng=np.random.default_rng(0))
    # Assert: only the two neighbouring levels, in proportion 0.7 / 0.3 (std ~0.001)
    assert set(np.unique(q).tolist()) == {5, 6}
    assert float(q.mean()) == pytest.approx(5.3, abs=0.005)


def test_masks_are_deterministic_per_seed_and_reduced_mod_m() -> None:
    # Execute
    a, b = prg_mask(b"s" * 32, 1000, 2**16), prg_mask(b"s" * 32, 1000, 2**16)
    other = prg_mask(b"t" * 32, 1000, 2**16)
    # Assert
    assert np.array_equal(a, b) and not np.array_equal(a, other)
    assert int(a.max()) < 2**16 and a.dtype == np.uint32
