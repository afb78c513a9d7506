"""The speculation budget without a model: drafts stay within the step's token budget, the sequence's
max_tokens and the context window, and never take a block that another sequence would need."""

from __future__ import annotations

from loraserve.engine.batch import StepOutput
from loraserve.engine.draft_budget import DraftBudget
from loraserve.engine.sampling_params import SamplingParams
from loraserve.engine.sequence import Request, Sequence
from loraserve.engine.speculative import NgramProposer, SpeculationStats
from loraserve.engine.step_costs import StepCosts
from tests.engine.test_scheduler import make_scheduler, tokenizer  # noqa: F401 - fixture

PROMPT = [100, 101, 102, 103, 104, 105, 106, 100, 101]  # its last tokens repeat its first: lookup finds drafts


def decoding(max_tokens: int) -> Sequence:
    """A sequence one token into its output, as prompt lookup will guess it."""
    request = Request("r", None, PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0.0), arrival_time=0.0)
    return Sequence(0, request, 0, [*PROMPT, 102], num_prompt_tokens=len(PROMPT))


def test_drafts_stay_within_the_step_budget_max_tokens_and_the_context_window(tokenizer):  # noqa: F811
    blocks = make_scheduler(tokenizer).block_manager

    def budget(max_model_len: int = 1024) -> DraftBudget:
        return DraftBudget(NgramProposer(8, 1, 2), blocks, StepCosts(), SpeculationStats(), max_model_len)

    assert budget().drafts(decoding(max_tokens=64), budget=64, num_running=1) == [103, 104, 105, 106, 100, 101, 102]
    assert len(budget().drafts(decoding(max_tokens=64), budget=4, num_running=1)) == 3, "the pending token's 1 + 3"
    assert len(budget().drafts(decoding(max_tokens=4), budget=64, num_running=1)) == 2, "1 out, its next + 2 = 4"
    assert len(budget(max_model_len=13).drafts(decoding(max_tokens=64), 64, 1)) == 2, "10 tokens, its next + 2 = 13"
    prompt_end = decoding(max_tokens=64)
    prompt_end.token_ids.pop()  # at its prompt's last token, where n > 1 siblings fork: no drafts
    assert budget().drafts(prompt_end, budget=64, num_running=1) == []


def test_drafts_whose_blocks_do_not_fit_are_dropped_and_nobody_gives_way_for_them(tokenizer):  # noqa: F811
    for num_blocks, expect_drafts in ((4, False), (8, True)):
        scheduler = make_scheduler(tokenizer, num_blocks=num_blocks)  # blocks of 4 tokens
        scheduler.draft_budget.proposer = NgramProposer(max_k=6, ngram_min=1, ngram_max=2)
        params = SamplingParams(max_tokens=12, temperature=0.0)
        drafter = Request("drafter", None, PROMPT, params, arrival_time=0.0)  # 9 tokens: 3 blocks, 3 places left
        other = Request("other", None, [7, 8, 9], params, arrival_time=0.0)  # 1 block, 1 place left
        scheduler.add_request(drafter)
        scheduler.add_request(other)
        scheduler.postprocess(scheduler.schedule(), StepOutput([102, 5], [None, None]))
        batch = scheduler.schedule()
        (drafting,) = (item for item in batch.scheduled if item.seq.request is drafter)
        assert bool(drafting.drafts) is expect_drafts
        assert {item.seq.request for item in batch.scheduled} == {drafter, other}
        assert scheduler.num_preemptions == 0
