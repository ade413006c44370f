"""The problem templates of the generated levels (basic -> intermediate -> two_step -> three_step -> multi_step ->
advanced),
with exact integer answers.

Every template samples its numbers, computes the answer with Python integer arithmetic and
also returns an arithmetic ``expression`` over the same numbers, so the ground truth can be
re-derived independently. Numbers are chosen so that every division is exact.
"""

from __future__ import annotations

import random
from typing import Callable

LEVELS = ("basic", "intermediate", "two_step", "three_step", "multi_step", "advanced")

# (question, expression, answer)
Problem = tuple[str, str, int]
Template = Callable[[random.Random], Problem]

NAMES = (
    "Tom", "Maria", "Aisha", "Liam", "Chen", "Sofia", "Ravi", "Emma",
    "Kofi", "Yuki", "Noah", "Lena", "Omar", "Priya", "Diego", "Hana",
)
OBJECTS = ("apples", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "cards")
ITEMS = ("notebook", "sandwich", "toy car", "comic book", "mug", "plant")
PURCHASES = ("bike", "game console", "jacket", "tablet", "guitar", "pair of shoes")


# --- basic: one operation, small non-negative numbers -------------------------------------

_ADD = (
    "What is {a} + {b}?",
    "Calculate {a} plus {b}.",
    "Find the sum of {a} and {b}.",
    "Add {a} and {b}. What do you get?",
)
_SUB = (
    "What is {a} - {b}?",
    "Calculate {a} minus {b}.",
    "Subtract {b} from {a}.",
    "What is the difference between {a} and {b}?",
)
_MUL = (
    "What is {a} * {b}?",
    "Calculate {a} times {b}.",
    "Find the product of {a} and {b}.",
    "Multiply {a} by {b}.",
)
_DIV = (
    "What is {a} / {b}?",
    "Calculate {a} divided by {b}.",
    "Divide {a} by {b}.",
    "How many times does {b} go into {a}?",
)


def _add(rng: random.Random) -> Problem:
    a, b = rng.randint(1, 99), rng.randint(1, 99)
    return rng.choice(_ADD).format(a=a, b=b), f"{a} + {b}", a + b


def _sub(rng: random.Random) -> Problem:
    a = rng.randint(2, 99)
    b = rng.randint(1, a)  # basic answers stay non-negative
    return rng.choice(_SUB).format(a=a, b=b), f"{a} - {b}", a - b


# A one-digit number times a number up to 40 (in either order): the one-digit times table alone holds 45
# distinct products, too few for held-out sets of distinct computations (`MIN_HELD_OUT_KEYS`).
def _mul(rng: random.Random) -> Problem:
    a, b = rng.randint(2, 9), rng.randint(2, 40)
    if rng.random() < 0.5:
        a, b = b, a
    return rng.choice(_MUL).format(a=a, b=b), f"{a} * {b}", a * b


def _div(rng: random.Random) -> Problem:
    b, quotient = rng.randint(2, 9), rng.randint(2, 40)
    a = b * quotient  # built from the quotient so the division is exact
    return rng.choice(_DIV).format(a=a, b=b), f"{a} // {b}", quotient


# --- two_step: two operations on one-digit numbers -----------------------------------------
# A bridge towards multi_step: the basic-trained 135M model solved multi_step's problems at pass@8
# 0.12-0.18, too rarely for GRPO's groups to hold a right answer. Here the steps are multi_step's
# (combine two results) and the numbers basic's easiest (one digit).

_TWO_STEP_EXPR = ("What is {e}?", "Calculate {e}.", "Evaluate {e}.", "Compute {e}.")


def _expr_two(rng: random.Random) -> Problem:
    a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9)
    expression, value = rng.choice(((f"{a} + {b} + {c}", a + b + c), (f"{a} + {b} - {c}", a + b - c),
                                     (f"{a} * {b} + {c}", a * b + c), (f"{a} * {b} - {c}", a * b - c)))
    if value < 0:  # answers stay non-negative, as in basic
        expression, value = f"{a} + {b} + {c}", a + b + c
    return rng.choice(_TWO_STEP_EXPR).format(e=expression), expression, value


def _more_then_less(rng: random.Random) -> Problem:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    c = rng.randint(1, min(9, a + b))
    q = (f"{name} has {a} {obj}, gets {b} more and then gives away {c}. "
         f"How many {obj} does {name} have now?")
    return q, f"{a} + {b} - {c}", a + b - c


def _groups_plus(rng: random.Random) -> Problem:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 9)
    q = (f"{name} has {a} bags with {b} {obj} in each bag and {c} more {obj}. "
         f"How many {obj} does {name} have in total?")
    return q, f"{a} * {b} + {c}", a * b + c


# --- three_step: three operations on one-digit numbers ---------------------------------------
# A second bridge towards multi_step: after two_step, the long ladder's multi_step stage gained 5.5-9 points on
# test (docs/results/long-ladder.md), short of the 10 a stage should gain. multi_step adds both a third operation
# and larger numbers, order of operations and parentheses; here only the third operation is new. Products come
# first or stand alone, so reading left to right gives the right order.

def _expr_three(rng: random.Random) -> Problem:
    a, b, c, d = (rng.randint(1, 9) for _ in range(4))
    # (expression, value, the lowest value on the way, left to right)
    expression, value, lowest = rng.choice(((f"{a} + {b} + {c} + {d}", a + b + c + d, 0),
                                             (f"{a} + {b} - {c} + {d}", a + b - c + d, a + b - c),
                                             (f"{a} + {b} + {c} - {d}", a + b + c - d, a + b + c - d),
                                             (f"{a} * {b} + {c} + {d}", a * b + c + d, 0),
                                             (f"{a} * {b} + {c} - {d}", a * b + c - d, a * b + c - d),
                                             (f"{a} * {b} - {c} + {d}", a * b - c + d, a * b - c),
                                             (f"{a} * {b} + {c} * {d}", a * b + c * d, 0)))
    if min(value, lowest) < 0:  # no negative number on the way, as in the levels below
        expression, value = f"{a} + {b} + {c} + {d}", a + b + c + d
    return rng.choice(_TWO_STEP_EXPR).format(e=expression), expression, value


def _more_less_more(rng: random.Random) -> Problem:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    a, b, d = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9)
    c = rng.randint(1, min(9, a + b))  # never more than there is
    q = (f"{name} has {a} {obj}, gets {b} more, gives away {c} and then finds {d} more. "
         f"How many {obj} does {name} have now?")
    return q, f"{a} + {b} - {c} + {d}", a + b - c + d


def _groups_plus_minus(rng: random.Random) -> Problem:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 9)
    d = rng.randint(1, min(9, a * b + c))  # never more than there is
    q = (f"{name} has {a} bags with {b} {obj} in each bag, gets {c} more {obj} and then gives away {d}. "
         f"How many {obj} does {name} have now?")
    return q, f"{a} * {b} + {c} - {d}", a * b + c - d


def _two_groups(rng: random.Random) -> Problem:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    a, b, c, d = (rng.randint(2, 9) for _ in range(4))
    q = (f"{name} has {a} bags with {b} {obj} in each bag and {c} boxes with {d} {obj} in each box. "
         f"How many {obj} does {name} have in total?")
    return q, f"{a} * {b} + {c} * {d}", a * b + c * d


# --- intermediate: one operation told as a word problem ---------------------------------------
# The step from basic is reading: the model must find the numbers in a story and pick the operation.
# Earlier versions needed two or three operations; the basic-trained 135M model solved those at
# pass@8 0.09-0.14, so GRPO's groups were nearly all wrong and the stage taught nothing (docs/log.md,
# "2026-11-27 — multi_step stays out of reach"). Two operations are the separate `two_step` stage.

def _story_add(rng: random.Random) -> Problem:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    a, b = rng.randint(5, 60), rng.randint(2, 40)
    q = f"{name} has {a} {obj} and gets {b} more. How many {obj} does {name} have now?"
    return q, f"{a} + {b}", a + b


def _story_together(rng: random.Random) -> Problem:
    x, y = rng.sample(NAMES, 2)
    obj = rng.choice(OBJECTS)
    a, b = rng.randint(5, 60), rng.randint(5, 40)
    q = f"{x} has {a} {obj} and {y} has {b} {obj}. How many {obj} do they have together?"
    return q, f"{a} + {b}", a + b


def _story_left(rng: random.Random) -> Problem:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    a = rng.randint(10, 60)
    b = rng.randint(2, a - 1)
    q = f"{name} has {a} {obj} and gives away {b}. How many {obj} does {name} have left?"
    return q, f"{a} - {b}", a - b


def _story_more_than(rng: random.Random) -> Problem:
    x, y = rng.sample(NAMES, 2)
    obj = rng.choice(OBJECTS)
    a = rng.randint(12, 60)
    b = rng.randint(2, a - 1)
    q = f"{x} has {a} {obj} and {y} has {b} {obj}. How many more {obj} does {x} have than {y}?"
    return q, f"{a} - {b}", a - b


# The products and quotients of this level reach 40 per group, as basic's do, so that its held-out sets
# can hold distinct computations (one-digit factors give 36 products).
def _story_bags(rng: random.Random) -> Problem:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    a, b = rng.randint(2, 9), rng.randint(2, 40)
    q = f"{name} has {a} bags with {b} {obj} in each bag. How many {obj} does {name} have?"
    return q, f"{a} * {b}", a * b


def _story_price(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count, price = rng.randint(2, 9), rng.randint(2, 40)
    q = f"One {item} costs {price} dollars. How many dollars does {name} pay for {count} of them?"
    return q, f"{count} * {price}", count * price


def _story_share(rng: random.Random) -> Problem:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    friends, each = rng.randint(2, 9), rng.randint(2, 40)
    q = (f"{name} shares {friends * each} {obj} equally among {friends} friends. "
         f"How many {obj} does each friend get?")
    return q, f"{friends * each} // {friends}", each


def _story_rows(rng: random.Random) -> Problem:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    per_row, rows = rng.randint(2, 9), rng.randint(2, 40)
    q = f"{name} puts {per_row * rows} {obj} in rows of {per_row}. How many rows does {name} make?"
    return q, f"{per_row * rows} // {per_row}", rows


# --- multi_step: two or three operations in words and expressions ---------------------------
# This was the intermediate stage until its problems proved out of reach of the basic-trained
# 135M model (pass@8 0.12-0.14; docs/log.md, "2026-11-27 — multi_step stays out of reach").
# Numbers stay small (mostly under 30): with two-digit operands throughout the model did no better.

def _buy_and_give(rng: random.Random) -> Problem:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    a, b = rng.randint(3, 20), rng.randint(2, 12)
    c = rng.randint(1, a + b)
    q = (f"{name} has {a} {obj}, buys {b} more and gives away {c}. "
         f"How many {obj} does {name} have now?")
    return q, f"{a} + {b} - {c}", a + b - c


def _boxes_plus_loose(rng: random.Random) -> Problem:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    a, b, c = rng.randint(2, 5), rng.randint(2, 6), rng.randint(1, 9)
    q = (f"{name} fills {a} boxes with {b} {obj} in each box and then finds {c} loose {obj}. "
         f"How many {obj} does {name} have in total?")
    return q, f"{a} * {b} + {c}", a * b + c


def _share_then_more(rng: random.Random) -> Problem:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    each, friends, extra = rng.randint(2, 6), rng.randint(2, 5), rng.randint(1, 9)
    total = each * friends
    q = (f"{name} shares {total} {obj} equally among {friends} friends. "
         f"One friend then gets {extra} more {obj}. How many {obj} does that friend have now?")
    return q, f"{total} // {friends} + {extra}", total // friends + extra


def _shelf(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    a = rng.randint(10, 30)
    b = rng.randint(1, 9)
    c = rng.randint(1, 9)
    d = rng.randint(1, min(9, a - b + c))
    q = (f"A shelf holds {a} books. {name} takes away {b} books, puts back {c} books "
         f"and then takes away {d} more. How many books are on the shelf now?")
    return q, f"{a} - {b} + {c} - {d}", a - b + c - d


def _change(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count, price = rng.randint(2, 9), rng.randint(2, 19)
    # count * price <= 171, so a 200-dollar bill always covers it; this range gives the held-out sets enough
    # distinct computations (up to 5 items at up to 9 dollars gave about 60)
    bill = rng.choice([b for b in (10, 20, 50, 100, 200) if b > count * price])
    q = (f"{name} buys {count} of the same {item} at {price} dollars each and pays with "
         f"{bill} dollars. How much change, in dollars, does {name} get back?")
    return q, f"{bill} - {count} * {price}", bill - count * price


def _expr_mixed(rng: random.Random) -> Problem:
    b, c = rng.randint(2, 5), rng.randint(2, 5)
    a = rng.randint(b * c, 40)  # non-negative: the order of operations is the lesson, not signs
    q = rng.choice(("What is {a} - {b} * {c}?", "Evaluate {a} - {b} * {c}.",
                    "Compute {a} - {b} * {c}.")).format(a=a, b=b, c=c)
    return q, f"{a} - {b} * {c}", a - b * c


def _expr_paren(rng: random.Random) -> Problem:
    a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(2, 5)
    d = rng.randint(1, min(9, (a + b) * c))
    q = rng.choice(("What is ({a} + {b}) * {c} - {d}?", "Evaluate ({a} + {b}) * {c} - {d}.",
                    "Compute ({a} + {b}) * {c} - {d}.")).format(a=a, b=b, c=c, d=d)
    return q, f"({a} + {b}) * {c} - {d}", (a + b) * c - d


def _ages(rng: random.Random) -> Problem:
    x, y, z = rng.sample(NAMES, 3)
    a, b = rng.randint(3, 30), rng.randint(1, 15)
    q = (f"{x} is {a} years old. {y} is {b} years older than {x}, and {z} is twice as old "
         f"as {y}. How old is {z}?")
    return q, f"2 * ({a} + {b})", 2 * (a + b)


# --- advanced: GSM8K-style, three or four steps with rates, prices and groups -------------

def _bakery(rng: random.Random) -> Problem:
    trays, per_tray, waste = rng.randint(3, 9), rng.randint(6, 12), rng.randint(1, 5)
    price, days = rng.randint(2, 5), rng.randint(2, 7)
    q = (f"A bakery bakes {trays} trays of muffins every day with {per_tray} muffins on each "
         f"tray. Each day {waste} muffins are dropped and thrown away, and every other muffin "
         f"is sold for {price} dollars. How many dollars does the bakery earn in {days} days?")
    return (q, f"({trays} * {per_tray} - {waste}) * {price} * {days}",
            (trays * per_tray - waste) * price * days)


def _wages(rng: random.Random) -> Problem:
    name, thing = rng.choice(NAMES), rng.choice(PURCHASES)
    rate, hours, days = rng.randint(10, 30), rng.randint(3, 8), rng.randint(3, 6)
    spent = rng.randint(20, rate * hours * days - 1)
    q = (f"{name} earns {rate} dollars per hour and works {hours} hours a day for {days} days. "
         f"Then {name} spends {spent} dollars on a {thing}. How many dollars of this pay "
         f"does {name} have left?")
    return q, f"{rate} * {hours} * {days} - {spent}", rate * hours * days - spent


def _teams(rng: random.Random) -> Problem:
    classes, team_size = rng.randint(3, 8), rng.randint(3, 6)
    per_class = team_size * rng.randint(4, 8)  # whole teams only
    balls = rng.randint(2, 5)
    q = (f"A school has {classes} classes with {per_class} students in each class. All the "
         f"students are split into teams of {team_size}, and each team needs {balls} balls. "
         f"How many balls does the school need?")
    return (q, f"{classes} * {per_class} // {team_size} * {balls}",
            classes * per_class // team_size * balls)


def _garden(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    rows, plants, per_plant = rng.randint(3, 8), rng.randint(4, 12), rng.randint(3, 10)
    bag = rng.randint(4, 12)
    total = rows * plants * per_plant
    kept = total % bag + bag * rng.randint(0, 2)  # leaves a whole number of bags
    q = (f"{name} plants {rows} rows of tomato plants with {plants} plants in each row. Each "
         f"plant gives {per_plant} tomatoes. {name} keeps {kept} tomatoes and sells the rest "
         f"in bags of {bag}. How many bags does {name} sell?")
    return (q, f"({rows} * {plants} * {per_plant} - {kept}) // {bag}",
            (total - kept) // bag)


def _train_trip(rng: random.Random) -> Problem:
    v1, h1, v2, h2 = rng.randint(40, 80), rng.randint(2, 5), rng.randint(30, 70), rng.randint(1, 4)
    distance = v1 * h1 + v2 * h2 + rng.randint(20, 300)
    q = (f"A train travels at {v1} miles per hour for {h1} hours and then at {v2} miles per "
         f"hour for {h2} hours. The city it is going to is {distance} miles from the start. "
         f"How many more miles does the train need to travel?")
    return (q, f"{distance} - ({v1} * {h1} + {v2} * {h2})",
            distance - (v1 * h1 + v2 * h2))


def _shopping(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    notebooks, n_price = rng.randint(2, 8), rng.randint(2, 9)
    pens, p_price = rng.randint(3, 12), rng.randint(1, 4)
    coupon = rng.randint(1, min(10, notebooks * n_price + pens * p_price - 1))
    q = (f"{name} buys {notebooks} notebooks at {n_price} dollars each and {pens} pens at "
         f"{p_price} dollars each, then uses a coupon for {coupon} dollars off. How many "
         f"dollars does {name} pay?")
    return (q, f"{notebooks} * {n_price} + {pens} * {p_price} - {coupon}",
            notebooks * n_price + pens * p_price - coupon)


def _savings(rng: random.Random) -> Problem:
    name, thing = rng.choice(NAMES), rng.choice(PURCHASES)
    weekly, weeks = rng.randint(5, 25), rng.randint(4, 12)
    cost = rng.randint(10, weekly * weeks)
    more = rng.randint(2, 8)
    q = (f"{name} saves {weekly} dollars every week. After {weeks} weeks, {name} buys a "
         f"{thing} for {cost} dollars and then keeps saving for {more} more weeks. How many "
         f"dollars has {name} saved now?")
    return (q, f"{weekly} * {weeks} - {cost} + {weekly} * {more}",
            weekly * weeks - cost + weekly * more)


def _recipe(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    cups, batch = rng.randint(2, 5), rng.randint(6, 12)
    cookies = batch * rng.randint(2, 6)  # whole batches only
    parties = rng.randint(2, 5)
    q = (f"A recipe uses {cups} cups of flour for every {batch} cookies. {name} wants to bake "
         f"{cookies} cookies for each of {parties} parties. How many cups of flour does "
         f"{name} need?")
    return (q, f"{cups} * ({cookies} // {batch}) * {parties}",
            cups * (cookies // batch) * parties)


def _farmer(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    box, days, price = rng.randint(4, 12), rng.randint(3, 7), rng.randint(3, 15)
    per_day = box * rng.randint(3, 10)  # whole boxes only
    q = (f"Farmer {name} picks {per_day} apples each day for {days} days, packs them into "
         f"boxes of {box} and sells each box for {price} dollars. How many dollars does "
         f"{name} make?")
    return (q, f"{per_day} * {days} // {box} * {price}",
            per_day * days // box * price)


_TEMPLATES: dict[str, tuple[Template, ...]] = {
    "basic": (_add, _sub, _mul, _div),
    "two_step": (_expr_two, _expr_two, _more_then_less, _groups_plus),
    "three_step": (_expr_three, _expr_three, _more_less_more, _groups_plus_minus, _two_groups),
    "intermediate": (_story_add, _story_together, _story_left, _story_more_than,
                     _story_bags, _story_price, _story_share, _story_rows),
    "multi_step": (_buy_and_give, _boxes_plus_loose, _share_then_more, _shelf, _change,
                   _expr_mixed, _expr_paren, _ages),
    "advanced": (_bakery, _wages, _teams, _garden, _train_trip, _shopping, _savings,
                 _recipe, _farmer),
}
