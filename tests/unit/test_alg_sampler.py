"""No-Positive-Resampling sampler: epochs, retirement at pass rate >= 0.9, exact resumption from a
state dict (SCALERL.md section 4)."""
import json

import pytest
import torch

from megatron_rl.algorithms import NoPositiveResamplingSampler, group_pass_rates

pytestmark = pytest.mark.unit


def test_each_epoch_is_a_permutation_and_epochs_differ():
    sampler = NoPositiveResamplingSampler(10, seed=3)
    epochs = []
    for expected_epoch in range(3):
        drawn = sampler.sample(10)
        assert sorted(drawn) == list(range(10))
        assert sampler.epoch == expected_epoch
        epochs.append(drawn)
    assert len({tuple(e) for e in epochs}) == 3
    # Drawing in odd chunk sizes gives the same stream.
    other = NoPositiveResamplingSampler(10, seed=3)
    stream = other.sample(7) + other.sample(0) + other.sample(13) + other.sample(10)
    assert stream == [p for epoch in epochs for p in epoch]
    assert other.sample(1)[0] in range(10) and other.epoch == 3
    assert NoPositiveResamplingSampler(10, seed=4).sample(10) != epochs[0]


def test_retired_prompts_leave_all_later_epochs():
    sampler = NoPositiveResamplingSampler(6, seed=0)
    first = sampler.sample(6)
    # Pass rates below, at and above 0.9; 9/10 in float32 is 0.89999998 and still counts.
    sampler.update([first[0], first[1], first[2], first[3]],
                   torch.tensor([0.85, 0.9, 1.0, 9 / 10], dtype=torch.float32))
    retired = {first[1], first[2], first[3]}
    assert sampler.num_retired == 3 and all(sampler.is_retired(p) for p in retired)
    for _ in range(4):
        epoch = sampler.sample(3)
        assert sorted(epoch) == sorted(set(range(6)) - retired)
    assert sampler.epoch == 4
    # A low pass rate later does not bring a prompt back; history is kept.
    sampler.update([first[1]], [0.0])
    assert sampler.is_retired(first[1])
    assert sampler.pass_rate_history(first[1]) == pytest.approx([0.9, 0.0])


def test_retirement_mid_epoch_skips_the_prompt_for_the_rest_of_it():
    sampler = NoPositiveResamplingSampler(4, seed=1)
    order = NoPositiveResamplingSampler(4, seed=1).sample(4)
    assert sampler.sample(1) == order[:1]
    sampler.update([order[3]], [1.0])  # not yet drawn this epoch (a late async update)
    assert sampler.sample(2) == order[1:3]
    assert order[3] not in sampler.sample(3)


def test_disabled_sampler_never_retires():
    sampler = NoPositiveResamplingSampler(3, enabled=False)
    sampler.update([0, 1, 2], [1.0, 1.0, 1.0])
    assert sampler.num_retired == 0
    assert sorted(sampler.sample(3)) == [0, 1, 2]
    assert sampler.pass_rate_history(2) == [1.0]


def test_all_retired_raises():
    sampler = NoPositiveResamplingSampler(2)
    sampler.update([0, 1], group_pass_rates(torch.ones(2, 4, dtype=torch.bool)))
    assert sampler.sample(0) == []
    with pytest.raises(RuntimeError, match="all 2 prompts are retired"):
        sampler.sample(1)


def _drive(sampler, num_steps):
    """A deterministic training loop: sample 3 prompts, report pass rates derived from ids."""
    stream = []
    for step in range(num_steps):
        ids = sampler.sample(3)
        stream.append(ids)
        sampler.update(ids, [1.0 if (pid + step) % 5 == 0 else 0.25 for pid in ids])
    return stream


@pytest.mark.parametrize("via_json", [False, True])
def test_state_dict_round_trip_resumes_exactly(via_json):
    original = NoPositiveResamplingSampler(11, seed=7)
    _drive(original, 5)  # mid-epoch, some prompts retired
    state = original.state_dict()
    if via_json:
        state = json.loads(json.dumps(state))
    restored = NoPositiveResamplingSampler(11, seed=99)  # seed comes from the state
    restored.load_state_dict(state)
    assert restored.epoch == original.epoch and restored.num_retired == original.num_retired
    assert _drive(restored, 12) == _drive(original, 12)
    assert restored.state_dict() == original.state_dict()
    assert original.num_retired > 0 and original.epoch >= 2


def test_sampler_input_errors():
    with pytest.raises(ValueError, match="num_prompts must be a positive int"):
        NoPositiveResamplingSampler(0)
    with pytest.raises(ValueError, match=r"threshold must be in \(0, 1\]"):
        NoPositiveResamplingSampler(3, threshold=1.5)
    sampler = NoPositiveResamplingSampler(3)
    with pytest.raises(ValueError, match=r"prompt id 3 is not in \[0, 3\)"):
        sampler.update([3], [0.5])
    with pytest.raises(ValueError, match=r"pass rate -1.0 of prompt 0 is not in \[0, 1\]"):
        sampler.update([0], [-1.0])
    with pytest.raises(ValueError, match="2 prompt ids but 1 pass rates"):
        sampler.update([0, 1], [0.5])
    with pytest.raises(ValueError, match="state is for 3 prompts but this sampler has 4"):
        NoPositiveResamplingSampler(4).load_state_dict(sampler.state_dict())
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        sampler.sample(-1)
