"""Speculative decoding's parts without a model: prompt lookup, acceptance, adaptive K, and the scheduler's
bookkeeping of drafts (the budget, blocks of rejected drafts released and never published)."""

from __future__ import annotations

from loraserve.engine.batch import StepOutput
from loraserve.engine.sampling_params import SamplingParams
from loraserve.engine.sequence import Request, Sequence
from loraserve.engine.speculative import RETRY_STEPS, NgramProposer, accepted_prefix, lookup
from tests.engine.test_scheduler import make_scheduler, tokenizer  # noqa: F401 (a fixture)


def test_lookup_proposes_what_followed_the_longest_latest_earlier_ngram():
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    assert lookup(tokens, 3, 1, 3) == [4, 9, 2]  # "1 2 3" occurred at the start
    assert lookup(tokens, 3, 1, 2) == [5, 6, 1]  # "2 3": the latest earlier occurrence wins
    assert lookup(tokens, 10, 3, 3) == [4, 9, 2, 3, 5, 6, 1, 2, 3]  # up to the end
    assert lookup([1, 2, 3, 4], 3, 1, 3) == []  # nothing repeats
    assert lookup([7, 7], 2, 1, 2) == [7]


def test_accepted_prefix_stops_at_the_first_draft_the_model_did_not_sample():
    assert accepted_prefix([5, 6, 7], [5, 6, 8, 9]) == 2
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 9]) == 3
    assert accepted_prefix([5, 6, 7], [1, 6, 7, 9]) == 0


def test_k_adapts_and_a_sequence_whose_drafts_miss_stops_drafting_for_a_while():
    proposer = NgramProposer(max_k=3, ngram_min=1, ngram_max=2)
    request = Request("r", None, [1, 2, 3, 1, 2], SamplingParams(), arrival_time=0.0)
    seq = Sequence(0, request, 0, [1, 2, 3, 1, 2], num_prompt_tokens=5)
    assert proposer.propose(seq, limit=8) == [3, 1, 2]
    proposer.observe(seq, 3, 0)
    proposer.observe(seq, 2, 0)
    proposer.observe(seq, 1, 0)
    assert seq.draft is not None and seq.draft.k == 0
    assert [proposer.propose(seq, 8) for _ in range(RETRY_STEPS - 1)] == [[]] * (RETRY_STEPS - 1)
    assert proposer.propose(seq, 8) == [3]  # one draft to try again
    proposer.observe(seq, 1, 1)
    assert proposer.propose(seq, 1) == [3]  # capped by the limit the step leaves


def test_drafts_are_cut_to_what_pays_for_its_compute_unless_the_check_is_off():
    request = Request("r", None, [1, 2, 3, 4, 5, 1, 2], SamplingParams(), arrival_time=0.0)
    for cost_check, draft_seconds, expected in ((True, 0.001, 4), (True, 0.004, 1), (True, 0.1, 0), (False, 0.1, 4)):
        seq = Sequence(0, request, 0, [1, 2, 3, 4, 5, 1, 2], num_prompt_tokens=7)
        proposer = NgramProposer(max_k=4, ngram_min=1, ngram_max=2, cost_check=cost_check)
        # Acceptance 0.5: k drafts are worth 0.5, 0.75, 0.875, 0.94 tokens of 10 ms.
        assert len(proposer.propose(seq, 8, token_seconds=0.01, draft_seconds=draft_seconds)) == expected


def repetitive_request(scheduler, max_tokens: int = 12) -> Request:
    """A prompt whose last token repeats an earlier one, so prompt lookup has drafts at once."""
    prompt = [100, 101, 102, 103, 104, 105, 106, 100, 101]
    request = Request("r", None, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), arrival_time=0.0)
    scheduler.add_request(request)
    return request


def test_drafts_count_against_the_budget_and_rejected_ones_give_their_blocks_back_unpublished(tokenizer):  # noqa: F811
    scheduler = make_scheduler(tokenizer, max_num_batched_tokens=64)
    scheduler.draft_budget.proposer = NgramProposer(max_k=6, ngram_min=1, ngram_max=2)
    request = repetitive_request(scheduler)
    prompt_step = scheduler.schedule()
    scheduler.postprocess(prompt_step, StepOutput([102], [None]))  # its first token, as lookup will guess
    seq = request.seqs[0]
    batch = scheduler.schedule()
    (item,) = batch.prefills
    assert item.drafts == [103, 104, 105, 106, 100, 101] and item.num_new_tokens == 7 and batch.num_tokens == 7
    assert item.input_token_ids == [102, 103, 104, 105, 106, 100, 101]
    blocks_with_drafts = len(seq.block_table)  # blocks of 4 tokens: 10 + 6 positions
    assert blocks_with_drafts == 4
    # The model agrees with the first draft only: 103 kept, 200 sampled at the next row.
    scheduler.postprocess(batch, StepOutput([103, 200, 1, 1, 1, 1, 1], [None] * 7))
    assert seq.output_token_ids == [102, 103, 200]
    assert seq.num_computed_tokens == 11  # prompt, 102 and 103; 200 is pending
    assert len(seq.block_table) == 3  # the fourth held only rejected drafts' K/V
    cache = scheduler.block_manager.prefix_cache
    assert cache is not None and len(cache) == 2  # the two blocks of kept tokens, not the third (partly drafts)
    assert scheduler.speculation.by_adapter[""].drafted == 6
    assert scheduler.speculation.by_adapter[""].accepted == 1


def test_every_draft_kept_gives_a_bonus_token_and_max_tokens_bounds_the_drafts(tokenizer):  # noqa: F811
    scheduler = make_scheduler(tokenizer)
    scheduler.draft_budget.proposer = NgramProposer(max_k=8, ngram_min=1, ngram_max=2)
    request = repetitive_request(scheduler, max_tokens=4)
    scheduler.postprocess(scheduler.schedule(), StepOutput([102], [None]))
    batch = scheduler.schedule()
    (item,) = batch.prefills
    assert item.drafts == [103, 104]  # 1 token out, 3 to go: two drafts and the bonus row
    scheduler.postprocess(batch, StepOutput([103, 104, 300], [None] * 3))
    seq = request.seqs[0]
    assert seq.output_token_ids == [102, 103, 104, 300] and seq.finish_reason == "length"
    assert scheduler.speculation.by_adapter[""].bonus == 1


def test_a_prompt_s_last_token_is_not_drafted_from_so_n_siblings_still_fork_there(tokenizer):  # noqa: F811
    scheduler = make_scheduler(tokenizer, max_num_batched_tokens=8)
    scheduler.draft_budget.proposer = NgramProposer(max_k=4, ngram_min=1, ngram_max=2)
    prompt = [100, 101, 102, 103, 104, 105, 106, 100, 101]  # 9 tokens: a chunk of 8, then its last one
    request = Request("r", None, prompt, SamplingParams(max_tokens=8, temperature=0.0, n=2), arrival_time=0.0)
    scheduler.add_request(request)
    scheduler.postprocess(scheduler.schedule(), StepOutput([], []))
    batch = scheduler.schedule()
    (item,) = batch.scheduled
    assert item.drafts == [] and len(item.samplers) == 2
    scheduler.postprocess(batch, StepOutput([102, 102], [None, None]))
    assert len(request.seqs) == 2
    drafting = scheduler.schedule()
    assert [len(item.drafts) for item in drafting.prefills] == [4, 2]  # both draft from there on, in the budget of 8
