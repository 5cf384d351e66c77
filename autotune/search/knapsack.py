"""The multiple-choice knapsack behind the noise budget (the tuner's) and the simulator's exact optimum."""
from __future__ import annotations

import numpy as np


def min_cost_choice(costs: list[list[float]], weights: list[list[int]], capacity: int) -> list[int]:
    """Multiple-choice knapsack by dynamic programming: per item, the index of the option to take so that the
    summed cost is least and the summed integer weight at most `capacity`. Every item needs an option of
    weight 0 (fp32), so some choice always fits; options heavier than `capacity` are never taken. Of options
    that tie, the first is taken."""
    # least[row, w]: least cost of the first `row` items within weight w. The choices are read back from the
    # table (an option was taken where it reproduces the cell exactly) rather than recorded per cell: recording
    # doubles the array operations, and their count, not their size, is what this costs.
    least = np.full((len(costs) + 1, capacity + 1), np.inf)
    least[0] = 0.0
    for row, (item_costs, item_weights) in enumerate(zip(costs, weights)):
        before, after = least[row], least[row + 1]
        for cost, weight in zip(item_costs, item_weights):
            if weight <= capacity:
                np.minimum(after[weight:], before[:capacity + 1 - weight] + cost, out=after[weight:])
    chosen, left = [0] * len(costs), capacity
    for row in range(len(costs) - 1, -1, -1):
        before, reached = least[row], least[row + 1][left]
        chosen[row] = next(index for index, (cost, weight) in enumerate(zip(costs[row], weights[row]))
                           if weight <= left and before[left - weight] + cost == reached)
        left -= weights[row][chosen[row]]
    return chosen
