import math

from autotune.search import SearchSpace, guided_search


def space(n, sensitive=()):
    """n modules; int8 halves each module's time; modules in `sensitive` carry large output error."""
    candidates = {f"m{i}": ["int8", "bf16", "fp16", "fp32"] for i in range(n)}
    latency = {name: {"fp32": 1.0, "int8": 0.5, "bf16": 0.7, "fp16": 4.0} for name in candidates}
    sensitivity = {name: {"fp32": 0.0, "bf16": 0.001, "fp16": 0.0001,
                          "int8": 0.5 if name in sensitive else 0.01} for name in candidates}
    return SearchSpace.build(candidates, sensitivity, latency)


def test_dtypes_slower_than_fp32_are_pruned_and_choices_sorted_fastest_first():
    s = space(3)
    assert s.choices["m0"] == ["int8", "bf16", "fp32"]
    assert s.size == 27
    assert s.fastest_plan() == {"m0": "int8", "m1": "int8", "m2": "int8"}


def test_fallback_path_moves_the_most_harmful_module_first_and_ends_at_fp32():
    s = space(4, sensitive={"m2"})
    path = s.fallback_path(s.fastest_plan())
    assert path[1]["m2"] == "bf16"                     # most error saved per ms lost
    assert all(dtype == "fp32" for dtype in path[-1].values())
    assert len(path) == 1 + 4 * 2                      # int8 -> bf16 -> fp32 for each module


def run_guided(s, passes):
    search, evaluated = guided_search(s), []
    try:
        plan = next(search)
        while True:
            evaluated.append(plan)
            plan = search.send(passes(plan))
    except StopIteration:
        return evaluated


def test_bisection_finds_the_passing_boundary_in_logarithmic_evaluations():
    n = 200
    s = space(n, sensitive={f"m{i}" for i in range(0, n, 10)})
    # Passes once every sensitive module has left int8.
    passes = lambda plan: all(plan[f"m{i}"] != "int8" for i in range(0, n, 10))
    evaluated = run_guided(s, passes)
    assert passes(evaluated[-1]) or any(passes(p) for p in evaluated)
    best = min((p for p in evaluated if passes(p)), key=lambda p: sum(v != "int8" for v in p.values()))
    assert sum(v == "int8" for v in best.values()) == n - n // 10      # only the sensitive ones moved
    assert len(evaluated) <= math.ceil(math.log2(2 * n)) + 2


def test_guided_search_stops_at_once_when_the_fastest_plan_passes():
    assert len(run_guided(space(50), lambda plan: True)) == 1


def test_exhaustive_order_lists_every_plan_once_fastest_predicted_first():
    from autotune.plan import plan_key
    from autotune.search import exhaustive_order
    s = space(3)
    plans = exhaustive_order(s)
    assert len({plan_key(p) for p in plans}) == len(plans) == s.size - 1     # all-fp32 is the baseline
    assert plans[0] == s.fastest_plan()
    assert all(any(d != "fp32" for d in p.values()) for p in plans)
