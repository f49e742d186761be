"""Fix 8 of megatron_rl/platform/sglang_cpu.py: the CPU MurmurHash3 behind SGLang's seeded
sampling (`multinomial_with_seed`), checked against a plain-Python transcription of SGLang's
Triton kernel (sglang/kernels/ops/sampling/murmur_hash.py), one value at a time. The live check,
a resumed run sampling the same tokens as an uninterrupted one, is in
tests/e2e/test_fault_tolerance.py."""
import pytest
import torch

from megatron_rl.platform.sglang_cpu import murmur_hash32_cpu

pytestmark = pytest.mark.unit

M = 0xFFFFFFFF


def _rotl(x, r):
    return ((x << r) | (x >> (32 - r))) & M


def _mix(h, k):
    k = _rotl((k * 0xCC9E2D51) & M, 15) * 0x1B873593 & M
    return (_rotl(h ^ k, 13) * 5 + 0xE6546B64) & M


def _fmix(h):
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & M
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & M
    return h ^ (h >> 16)


def _reference(seed, position, column):
    h = 0
    for block in (seed & M, (seed >> 32) & M, position, column):
        h = _mix(h, block)
    return _fmix(h ^ 16)


def test_cpu_murmur_hash_matches_sglangs_kernel_bit_for_bit():
    seeds = torch.tensor([0, 1, 12345678901234, 2**63 - 1])
    positions = torch.tensor([0, 5, 70000, 2**31 - 1])
    columns = torch.arange(257)
    out = murmur_hash32_cpu(seeds, positions, columns)
    assert out.shape == (4, 257)
    expected = torch.tensor([[_reference(int(s), int(p), int(c)) for c in columns]
                             for s, p in zip(seeds, positions)])
    assert torch.equal(out, expected)
    uniform = out.double() / 2**32  # what multinomial_with_seed turns into Gumbel noise
    assert 0.45 < float(uniform.mean()) < 0.55 and len(set(out[0].tolist())) == 257
