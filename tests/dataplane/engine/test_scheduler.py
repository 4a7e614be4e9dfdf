"""Scheduler: token budget, chunked prefill, mixed steps, preemption order, priorities, abort."""

from modelfleet.dataplane.engine.block_manager import BlockManager
from modelfleet.dataplane.engine.scheduler import Scheduler, SchedulerOutput
from modelfleet.dataplane.engine.sequence import Sequence, SequenceStatus
from modelfleet.dataplane.sampling_params import SamplingParams

BLOCK = 4
NEXT_TOKEN = 7


def make_scheduler(num_blocks=64, budget=64, max_num_seqs=8, chunked=True, prefix=True, max_model_len=1000):
    bm = BlockManager(num_blocks, BLOCK, enable_prefix_caching=prefix)
    return Scheduler(
        bm,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
    )


def add(sched: Scheduler, request_id: str, num_tokens: int, *, priority=0, max_tokens=100, first=0, **kw):
    seq = Sequence(
        request_id,
        list(range(first, first + num_tokens)),
        SamplingParams(max_tokens=max_tokens, **kw),
        priority=priority,
    )
    sched.add(seq)
    return seq


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(s.seq.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step where the model always proposes NEXT_TOKEN."""
    out = sched.schedule()
    sched.update(out, [NEXT_TOKEN if s.samples else None for s in out.scheduled])
    return out


def test_prefill_then_decode_with_continuous_admission():
    sched = make_scheduler()
    a = add(sched, "a", 5)
    assert plan(step(sched)) == [("a", 0, 5)]
    assert a.output_token_ids == [NEXT_TOKEN]
    # A request arriving later joins the running batch at the next step.
    add(sched, "b", 3, first=100)
    assert plan(step(sched)) == [("a", 5, 1), ("b", 0, 3)]
    assert plan(step(sched)) == [("a", 6, 1), ("b", 3, 1)]
    assert a.output_token_ids == [NEXT_TOKEN] * 3
    assert a.block_ids == [0, 1]


def test_chunked_prefill_splits_long_prompts_under_the_token_budget():
    sched = make_scheduler(budget=8)
    a = add(sched, "a", 10)
    add(sched, "b", 3, first=100)
    out = step(sched)
    assert plan(out) == [("a", 0, 8)]
    assert a.output_token_ids == []  # no token until the whole prompt is in
    assert plan(step(sched)) == [("a", 8, 2), ("b", 0, 3)]
    assert a.output_token_ids == [NEXT_TOKEN]
    # Decode and the rest fit together.
    assert plan(step(sched)) == [("a", 10, 1), ("b", 3, 1)]


def test_decodes_and_prefill_chunk_share_a_step():
    sched = make_scheduler(budget=6)
    add(sched, "a", 2)
    step(sched)
    add(sched, "b", 20, first=100)
    assert plan(step(sched)) == [("a", 2, 1), ("b", 0, 5)]
    assert plan(step(sched)) == [("a", 3, 1), ("b", 5, 5)]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    sched = make_scheduler(budget=10, chunked=False)
    add(sched, "a", 6)
    add(sched, "b", 6, first=100)
    assert plan(step(sched)) == [("a", 0, 6)]
    assert plan(step(sched)) == [("a", 6, 1), ("b", 0, 6)]


def test_max_num_seqs_limits_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    for name in "abc":
        add(sched, name, 2, first=ord(name) * 10)
    assert [s.seq.request_id for s in step(sched).scheduled] == ["a", "b"]
    assert [s.request_id for s in sched.waiting] == ["c"]


def test_priority_orders_admission_lower_first_then_fcfs():
    sched = make_scheduler(max_num_seqs=1)
    add(sched, "late-low", 4, priority=5, max_tokens=1)
    add(sched, "high-1", 4, priority=-1, first=100, max_tokens=1)
    add(sched, "mid", 4, priority=0, first=200, max_tokens=1)
    add(sched, "high-2", 4, priority=-1, first=300, max_tokens=1)
    order = [plan(step(sched))[0][0] for _ in range(4)]
    assert order == ["high-1", "high-2", "mid", "late-low"]
    assert not sched.has_unfinished()


def test_preemption_frees_the_newest_request_and_recomputes_it():
    # 3 blocks of 4 slots: a and b take one block each, then decode until the pool runs out.
    sched = make_scheduler(num_blocks=3)
    a = add(sched, "a", 4)
    b = add(sched, "b", 4, first=100)
    assert plan(step(sched)) == [("a", 0, 4), ("b", 0, 4)]
    assert (a.block_ids, b.block_ids) == ([0], [1])
    # a needs a second block (slot for its 5th token) and gets the last free one.
    out = step(sched)
    assert plan(out) == [("a", 4, 1)]
    assert sched.num_preemptions == 1
    assert b.status is SequenceStatus.PREEMPTED
    assert b.block_ids == [] and b.num_computed_tokens == 0
    assert a.block_ids == [0, 2]
    assert b.output_token_ids == [NEXT_TOKEN]
    # b comes back when a finishes, and recomputes prompt plus generated token in one go.
    sched.finish("a", "stop")
    out = step(sched)
    assert plan(out) == [("b", 4, 1)]  # its full prompt block was still in the prefix cache
    assert b.output_token_ids == [NEXT_TOKEN, NEXT_TOKEN]
    assert b.num_cached_tokens == 0  # counted at first admission only


def test_preemption_takes_the_lowest_priority_even_if_older():
    sched = make_scheduler(num_blocks=3, prefix=False)
    low = add(sched, "low", 4, priority=1)
    high = add(sched, "high", 4, priority=0, first=100)
    step(sched)
    assert [s.request_id for s in sched.running] == ["high", "low"]
    out = step(sched)
    assert sched.num_preemptions == 1
    assert plan(out) == [("high", 4, 1)]
    assert high.block_ids == [0, 2]
    assert low.status is SequenceStatus.PREEMPTED


def test_a_lone_request_that_cannot_grow_preempts_itself():
    sched = make_scheduler(num_blocks=1, prefix=False)
    a = add(sched, "a", 4)
    step(sched)
    out = step(sched)
    assert sched.num_preemptions == 1
    assert out.scheduled == []
    assert a.status is SequenceStatus.PREEMPTED


def test_abort_frees_blocks_at_once_from_running_and_waiting():
    sched = make_scheduler(num_blocks=8, max_num_seqs=1, prefix=False)
    a = add(sched, "a", 9)
    b = add(sched, "b", 3, first=100)
    step(sched)
    assert sched.block_manager.num_free_blocks == 5
    aborted = sched.finish("a", "abort")
    assert aborted is a and a.finish_reason == "abort" and a.is_finished
    assert sched.block_manager.num_free_blocks == 8
    assert a.block_ids == []
    assert sched.finish("b", "abort") is b
    assert not sched.has_unfinished()
    assert sched.finish("missing", "abort") is None


def test_stop_token_and_max_tokens_finish_and_free():
    sched = make_scheduler()
    a = add(sched, "a", 3, max_tokens=2)
    b = add(sched, "b", 3, first=100, stop_token_ids=[NEXT_TOKEN])
    step(sched)
    assert b.finish_reason == "stop" and b.block_ids == []
    step(sched)
    assert a.finish_reason == "length"
    assert a.output_token_ids == [NEXT_TOKEN, NEXT_TOKEN]
    assert sched.block_manager.num_free_blocks == 64
    assert not sched.has_unfinished()


def test_max_model_len_ends_a_request_with_length():
    sched = make_scheduler(max_model_len=6)
    a = add(sched, "a", 4)
    step(sched)
    step(sched)
    assert a.num_tokens == 6 and a.finish_reason == "length"


def test_duplicate_request_id_is_refused():
    sched = make_scheduler()
    add(sched, "a", 2)
    try:
        add(sched, "a", 2)
    except ValueError as err:
        assert "request_id" in str(err)
    else:
        raise AssertionError("duplicate request id accepted")


def test_a_higher_priority_arrival_preempts_lower_priority_requests_for_blocks():
    sched = make_scheduler(num_blocks=4, prefix=False)
    # Two blocks each, with room left in them for the next decodes.
    low_old = add(sched, "low-old", 6, priority=1)
    low_new = add(sched, "low-new", 6, priority=1, first=100)
    step(sched)
    assert sched.block_manager.num_free_blocks == 0
    urgent = add(sched, "urgent", 4, priority=0, first=200)
    out = step(sched)
    # The newest of the lower-priority requests makes room; the older one keeps running.
    assert sched.num_preemptions == 1
    assert low_new.status is SequenceStatus.PREEMPTED and low_new.block_ids == []
    assert plan(out)[-1] == ("urgent", 0, 4)
    assert urgent.block_ids == [2]
    assert low_old.status is SequenceStatus.RUNNING


def test_equal_priority_arrival_waits_instead_of_preempting():
    sched = make_scheduler(num_blocks=4, prefix=False)
    add(sched, "a", 6)
    add(sched, "b", 6, first=100)
    step(sched)
    add(sched, "c", 4, first=200)
    out = step(sched)
    assert sched.num_preemptions == 0
    assert [rid for rid, *_ in plan(out)] == ["a", "b"]


def test_no_admission_in_a_step_that_had_to_preempt():
    # 3 blocks: a and b take one each. Next step a takes the last free block and b, unable to grow,
    # preempts itself, freeing a block that would fit the waiting c; c still waits for the next step.
    sched = make_scheduler(num_blocks=3, prefix=False)
    a = add(sched, "a", 4)
    b = add(sched, "b", 4, first=100)
    step(sched)
    c = add(sched, "c", 2, priority=-1, first=200)
    out = step(sched)
    assert sched.num_preemptions == 1
    assert plan(out) == [("a", 4, 1)]
    assert sched.block_manager.num_free_blocks == 1  # room for c, left unused in this step
    assert c.status is SequenceStatus.WAITING and b.status is SequenceStatus.PREEMPTED
    assert a.block_ids == [0, 2]
    # The next step, with no preemption, admits c (higher priority than b).
    out = step(sched)
    assert sched.num_preemptions == 1  # none more
    assert plan(out) == [("a", 5, 1), ("c", 0, 2)]


def test_unfinished_and_empty_steps_are_reported():
    sched = make_scheduler(max_num_seqs=1)
    assert not sched.has_unfinished()
    assert sched.schedule().is_empty
    a = add(sched, "a", 3, max_tokens=1)
    b = add(sched, "b", 3, first=100, max_tokens=1)
    assert sched.has_unfinished()  # waiting only
    out = sched.schedule()
    assert not out.is_empty and plan(out) == [("a", 0, 3)]
    assert (len(sched.running), len(sched.waiting)) == (1, 1)
    sched.update(out, [NEXT_TOKEN])
    assert a.is_finished
    assert sched.has_unfinished() and (len(sched.running), len(sched.waiting)) == (0, 1)
    step(sched)
    assert b.is_finished and not sched.has_unfinished()


def test_first_token_time_is_the_first_tokens():
    sched = make_scheduler()
    a = add(sched, "a", 3)
    assert a.first_token_time is None
    step(sched)
    first = a.first_token_time
    assert first is not None
    step(sched)
    step(sched)
    assert a.first_token_time == first and len(a.output_token_ids) == 3


def test_a_step_whose_budget_is_spent_plans_nothing_more():
    sched = make_scheduler(budget=4)
    add(sched, "b", 2)
    step(sched)
    add(sched, "a", 10, priority=-1, first=100)
    assert plan(step(sched)) == [("b", 2, 1), ("a", 0, 3)]
    # a (higher priority) now runs first and takes the whole budget: b gets no empty slot in the step.
    assert plan(step(sched)) == [("a", 3, 4)]


def test_without_chunked_prefill_a_prompt_exactly_the_budget_is_admitted():
    sched = make_scheduler(budget=8, chunked=False)
    add(sched, "a", 8)
    assert plan(step(sched)) == [("a", 0, 8)]


def held_scheduler(wait_steps: int) -> Scheduler:
    sched = make_scheduler()
    sched.prefill_wait_steps = wait_steps
    return sched


def test_requests_arriving_one_by_one_are_held_and_admitted_together():
    sched = held_scheduler(3)
    add(sched, "a", 5)
    assert plan(step(sched)) == [("a", 0, 5)]  # nothing running: admitted at once
    add(sched, "b", 3, first=100)
    assert plan(step(sched)) == [("a", 5, 1)]  # held: the step stays pure decodes
    add(sched, "c", 2, first=200)
    assert plan(step(sched)) == [("a", 6, 1)]
    assert plan(step(sched)) == [("a", 7, 1)]
    # The third held step was the last: both join the next one together.
    assert plan(step(sched)) == [("a", 8, 1), ("b", 0, 3), ("c", 0, 2)]
    assert plan(step(sched)) == [("a", 9, 1), ("b", 3, 1), ("c", 2, 1)]


def test_a_step_with_prompt_tokens_admits_waiting_requests_at_once():
    sched = held_scheduler(4)
    sched.max_num_batched_tokens = 6
    add(sched, "a", 10)  # a prompt longer than the budget: chunked over two steps
    assert plan(step(sched)) == [("a", 0, 6)]
    add(sched, "b", 1, first=100)
    assert plan(step(sched)) == [("a", 6, 4), ("b", 0, 1)]  # not pure decodes: nothing to keep


def test_without_a_wait_every_step_admits():
    sched = held_scheduler(0)
    add(sched, "a", 5)
    step(sched)
    add(sched, "b", 3, first=100)
    assert plan(step(sched)) == [("a", 5, 1), ("b", 0, 3)]


def test_a_request_that_preempted_others_for_its_blocks_is_not_held():
    sched = make_scheduler(num_blocks=4, prefix=False)
    sched.prefill_wait_steps = 4
    add(sched, "high", 6, priority=0)
    low = add(sched, "low", 6, priority=1, first=100)
    step(sched)
    assert sched.block_manager.num_free_blocks == 0
    urgent = add(sched, "urgent", 4, priority=0, first=200)
    out = step(sched)
    # Its first chunk's blocks came from preempting "low": it runs now, not after 4 held steps.
    assert low.status is SequenceStatus.PREEMPTED
    assert plan(out) == [("high", 6, 1), ("urgent", 0, 4)]
    assert urgent.status is SequenceStatus.RUNNING
    # The preempted request waits as any other: held while the steps are pure decodes.
    assert plan(step(sched)) == [("high", 7, 1), ("urgent", 4, 1)]


def test_waiting_requests_that_fill_the_step_are_not_held():
    sched = held_scheduler(4)
    sched.max_num_batched_tokens = 8
    add(sched, "a", 3)
    step(sched)
    add(sched, "b", 3, first=100)
    assert plan(step(sched)) == [("a", 3, 1)]  # 3 prompt tokens of the 7 left: held
    add(sched, "c", 4, first=200)
    # b and c fill the 7 tokens the decode leaves: holding them longer would gather nothing more.
    assert plan(step(sched)) == [("a", 4, 1), ("b", 0, 3), ("c", 0, 4)]
