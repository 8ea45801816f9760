"""Procedural geometry problems in Geometry3K's schema: a drawn diagram, a problem, an answer and a
worked solution, made from a random generator, with no dataset to download.

Kinds (`KINDS`), each drawn to scale with its givens labelled on the figure:
- triangle:      two angles of a triangle given, the third asked (angle sum);
- isosceles:     the apex angle of an isosceles triangle (equal sides ticked), a base angle asked;
- parallel:      two parallel lines cut by a transversal, an angle given, a corresponding, alternate
                 or co-interior one asked;
- pythagoras:    a right triangle's legs (or a leg and the hypotenuse), the third side asked; the
                 answer an integer or a surd such as 2\\sqrt{5};
- area:          a triangle's base and height, or a rectangle's sides, its area or perimeter asked;
                 the answer an integer or a fraction such as \\frac{35}{2};
- arc:           a circle's radius and a central angle, the arc length or the sector area asked,
                 in terms of pi (\\frac{10\\pi}{3}).
A share of the problems (`choice_share`) lists four choices A-D and asks for the letter, as
Geometry3K does. Answers are written as math-verify reads them (tasks/geometry.py scores them).

`make_problem(rng, ...)` draws one; the geometry task serves them with `source=procedural`
(deterministic from seed, split and index; train and test disjoint by the problem's content) and
`vlmrl data geometry OUT` writes them as Geometry3K-schema files (data_export.py). No torch here.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from fractions import Fraction

from PIL import Image, ImageDraw, ImageFont

KINDS = ("triangle", "isosceles", "parallel", "pythagoras", "area", "arc")
INK, GIVEN, ASKED = (0, 0, 0), (20, 60, 200), (200, 30, 30)


@dataclass
class Problem:
    """One generated problem: the question (with Geometry3K's `<image>` marker), the answer as
    math-verify reads it, a worked solution, the diagram, and what kind it is."""

    problem: str
    answer: str
    solution: str
    image: Image.Image
    kind: str

    @property
    def key(self) -> str:
        """Its content, which decides its split. The givens are written only in the diagram and the
        solution: without the solution, problems of one kind and answer would share a split."""
        return f"{self.kind}|{self.problem}|{self.answer}|{self.solution}"


# --------------------------------------------------------------------------- numbers as LaTeX


def latex_number(value: Fraction, unit: str = "") -> str:
    """7, \\frac{35}{2}, or with unit "\\pi": \\pi, 5\\pi, \\frac{10\\pi}{3}."""
    value = Fraction(value)
    sign = "-" if value < 0 else ""
    value = abs(value)
    top, bottom = value.numerator, value.denominator
    head = unit if top == 1 and unit else f"{top}{unit}"
    return sign + (head if bottom == 1 else f"\\frac{{{head}}}{{{bottom}}}")


def latex_sqrt(n: int) -> str:
    """sqrt(n) simplified: 5, 2\\sqrt{5}, \\sqrt{41}."""
    outside, inside = 1, n
    for factor in range(int(math.isqrt(n)), 1, -1):
        if inside % (factor * factor) == 0:
            outside, inside = factor, inside // (factor * factor)
            break
    if inside == 1:
        return str(outside)
    return (f"{outside}" if outside > 1 else "") + f"\\sqrt{{{inside}}}"


# --------------------------------------------------------------------------- drawing


class Canvas:
    """A square white image, math coordinates (y up) fitted into it with a margin."""

    def __init__(self, size: int, points: list[tuple[float, float]], margin: float = 0.16):
        self.image = Image.new("RGB", (size, size), "white")
        self.draw = ImageDraw.Draw(self.image)
        self.font = ImageFont.load_default(size=max(10, size // 16))
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        span = max(max(xs) - min(xs), max(ys) - min(ys), 1e-9)
        self.scale = size * (1 - 2 * margin) / span
        self.origin = (min(xs), min(ys))
        self.offset = ((size - (max(xs) - min(xs)) * self.scale) / 2, (size - (max(ys) - min(ys)) * self.scale) / 2)
        self.size = size
        self.width = max(1, size // 112)

    def at(self, point: tuple[float, float]) -> tuple[float, float]:
        x = self.offset[0] + (point[0] - self.origin[0]) * self.scale
        y = self.offset[1] + (point[1] - self.origin[1]) * self.scale
        return x, self.size - y

    def line(self, a, b, color=INK, dashed: bool = False) -> None:
        (x0, y0), (x1, y1) = self.at(a), self.at(b)
        if not dashed:
            self.draw.line([(x0, y0), (x1, y1)], fill=color, width=self.width)
            return
        steps = max(2, int(math.hypot(x1 - x0, y1 - y0) // 6))
        for k in range(0, steps, 2):
            t0, t1 = k / steps, min((k + 1) / steps, 1.0)
            self.draw.line([(x0 + (x1 - x0) * t0, y0 + (y1 - y0) * t0), (x0 + (x1 - x0) * t1, y0 + (y1 - y0) * t1)],
                           fill=color, width=self.width)

    def polygon(self, points) -> None:
        for a, b in zip(points, points[1:] + points[:1]):
            self.line(a, b)

    def text(self, point, text: str, color=INK) -> None:
        self.draw.text(self.at(point), text, fill=color, font=self.font, anchor="mm")

    def angle_label(self, vertex, toward_a, toward_b, text: str, color=INK, distance: float = 0.0) -> None:
        """`text` inside the angle at `vertex` between the rays to `toward_a` and `toward_b`."""
        bisector = _unit(_add(_unit(_sub(toward_a, vertex)), _unit(_sub(toward_b, vertex))))
        reach = distance or 0.22 * min(_length(_sub(toward_a, vertex)), _length(_sub(toward_b, vertex)))
        self.text(_add(vertex, _mul(bisector, reach)), text, color)

    def tick(self, a, b) -> None:
        """A tick mark across the middle of segment ab (equal sides)."""
        middle, normal = _mul(_add(a, b), 0.5), _unit((-(b[1] - a[1]), b[0] - a[0]))
        half = 6 / self.scale
        self.line(_add(middle, _mul(normal, half)), _sub(middle, _mul(normal, half)))


def _add(a, b):
    return a[0] + b[0], a[1] + b[1]


def _sub(a, b):
    return a[0] - b[0], a[1] - b[1]


def _mul(a, k):
    return a[0] * k, a[1] * k


def _length(a):
    return math.hypot(a[0], a[1]) or 1e-9


def _unit(a):
    return _mul(a, 1 / _length(a))


def triangle_from_angles(a: float, b: float) -> list[tuple[float, float]]:
    """Vertices A, B, C of a triangle with angle `a` at A, `b` at B (degrees), AB of length 1."""
    c = 180 - a - b
    side_ac = math.sin(math.radians(b)) / math.sin(math.radians(c))  # law of sines, AB = 1
    return [(0.0, 0.0), (1.0, 0.0), (side_ac * math.cos(math.radians(a)), side_ac * math.sin(math.radians(a)))]


# --------------------------------------------------------------------------- the kinds

PI = "\\pi"


@dataclass
class Drawn:
    """What a kind makes: the question, the answer, a worked solution, the diagram, and wrong
    answers of the same form (for multiple choice)."""

    question: str
    answer: str
    solution: str
    image: Image.Image
    wrong: list[str]


def _near(value: int, low: int = 1) -> list[str]:
    """Plausible wrong integers near `value` (at least `low`)."""
    return sorted({str(v) for v in (value - 10, value - 5, value + 5, value + 10, 180 - value, 90 - value)
                   if v >= low and v != value})


def _triangle(rng: random.Random, size: int) -> Drawn:
    a, b = rng.randint(25, 95), rng.randint(25, 95)
    while a + b > 155:
        a, b = rng.randint(25, 95), rng.randint(25, 95)
    c = 180 - a - b
    A, B, C = triangle_from_angles(a, b)
    canvas = Canvas(size, [A, B, C])
    canvas.polygon([A, B, C])
    canvas.angle_label(A, B, C, f"{a}°", GIVEN)
    canvas.angle_label(B, A, C, f"{b}°", GIVEN)
    canvas.angle_label(C, A, B, "x°", ASKED)
    return Drawn("Find x.", str(c), f"The angles of a triangle add up to 180°, so x = 180 - {a} - {b} = {c}.",
                 canvas.image, _near(c))


def _isosceles(rng: random.Random, size: int) -> Drawn:
    apex = 2 * rng.randint(10, 70)
    base = (180 - apex) // 2
    A, B, C = triangle_from_angles(base, base)
    canvas = Canvas(size, [A, B, C])
    canvas.polygon([A, B, C])
    canvas.tick(A, C)
    canvas.tick(B, C)
    canvas.angle_label(C, A, B, f"{apex}°", GIVEN)
    canvas.angle_label(A, B, C, "x°", ASKED)
    return Drawn("The triangle is isosceles, with the two marked sides equal. Find x.", str(base),
                 f"The base angles of an isosceles triangle are equal and the three angles add up to 180°, "
                 f"so 2x = 180 - {apex} and x = {base}.", canvas.image, _near(base) + [str(apex)])


def _parallel(rng: random.Random, size: int) -> Drawn:
    theta = rng.choice([k for k in range(35, 146, 5) if k != 90])  # between the rightward ray and the transversal
    relation = rng.choice(["corresponding", "alternate", "co-interior"])
    slope = 1 / math.tan(math.radians(theta))  # the transversal's dx per unit of dy
    top, bottom = (slope, 1.0), (0.0, 0.0)  # where the transversal meets l (y = 1) and m (y = 0)
    canvas = Canvas(size, [(-1.6, -0.5), (1.6, 1.5), top, bottom])
    canvas.line((-1.6, 1.0), (1.6, 1.0))
    canvas.line((-1.6, 0.0), (1.6, 0.0))
    canvas.line(_add(bottom, (-slope * 0.45, -0.45)), _add(top, (slope * 0.45, 0.45)))
    canvas.text((-1.45, 1.12), "l")
    canvas.text((-1.45, 0.12), "m")
    right, left, up, down = (1.0, 0.0), (-1.0, 0.0), (slope, 1.0), (-slope, -1.0)
    given = {"corresponding": (right, up, theta), "alternate": (left, down, theta),
             "co-interior": (right, down, 180 - theta)}[relation]  # the marked angle at l
    canvas.angle_label(top, _add(top, given[0]), _add(top, given[1]), f"{given[2]}°", GIVEN, 0.3)
    canvas.angle_label(bottom, _add(bottom, right), _add(bottom, up), "x°", ASKED, 0.3)
    why = {"corresponding": "corresponding angles are equal", "alternate": "alternate angles are equal",
           "co-interior": f"co-interior angles add up to 180°, so x = 180 - {180 - theta}"}[relation]
    return Drawn("Lines l and m are parallel. Find x.", str(theta),
                 f"l and m are parallel and {why}: x = {theta}.", canvas.image, _near(theta))


def _right_triangle(canvas_size: int, a: int, b: int) -> tuple[Canvas, list]:
    C, A, B = (0.0, 0.0), (float(b), 0.0), (0.0, float(a))
    canvas = Canvas(canvas_size, [A, B, C])
    canvas.polygon([A, B, C])
    mark = 0.09 * max(a, b)
    canvas.line((mark, 0.0), (mark, mark))
    canvas.line((0.0, mark), (mark, mark))
    spot = 0.08 * max(a, b)
    return canvas, [(-spot, a / 2), (b / 2, -spot), (b / 2 + spot, a / 2 + spot)]  # where the legs' and hypotenuse's labels go


def _pythagoras(rng: random.Random, size: int) -> Drawn:
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    square = a * a + b * b
    canvas, spots = _right_triangle(size, a, b)
    if math.isqrt(square) ** 2 == square and rng.random() < 0.5:  # a Pythagorean triple: ask a leg
        c = math.isqrt(square)
        for spot, text, color in zip(spots, ("x", str(b), str(c)), (ASKED, GIVEN, GIVEN)):
            canvas.text(spot, text, color)
        return Drawn("The triangle has a right angle. Find x.", str(a),
                     f"By Pythagoras, x^2 = {c}^2 - {b}^2 = {c * c - b * b}, so x = {a}.", canvas.image,
                     _near(a) + [str(c)])
    for spot, text, color in zip(spots, (str(a), str(b), "x"), (GIVEN, GIVEN, ASKED)):
        canvas.text(spot, text, color)
    answer = latex_sqrt(square)
    return Drawn("The triangle has a right angle. Find x.", answer,
                 f"By Pythagoras, x^2 = {a}^2 + {b}^2 = {square}, so x = {answer}.", canvas.image,
                 [latex_sqrt(square + k) for k in (-3, -2, -1, 1, 2, 3)] + [str(a + b)])


def _area(rng: random.Random, size: int) -> Drawn:
    if rng.random() < 0.5:  # a triangle's area from its base and height
        base, height = rng.randint(3, 15), rng.randint(2, 12)
        apex_x = round(rng.uniform(0.2, 0.8) * base, 2)
        A, B, C = (0.0, 0.0), (float(base), 0.0), (apex_x, float(height))
        canvas = Canvas(size, [A, B, C])
        canvas.polygon([A, B, C])
        canvas.line(C, (apex_x, 0.0), dashed=True)
        canvas.text((base / 2, -0.07 * max(base, height)), str(base), GIVEN)
        canvas.text((apex_x + 0.07 * max(base, height), height / 2), str(height), GIVEN)
        area = Fraction(base * height, 2)
        return Drawn("Find the area of the triangle.", latex_number(area),
                     f"The area is half the base times the height: {base} x {height} / 2 = {latex_number(area)}.",
                     canvas.image, [latex_number(area * 2), latex_number(area + 1), latex_number(area + base),
                                    latex_number(area - 1) if area > 1 else latex_number(area + 3)])
    width, height = rng.randint(2, 15), rng.randint(2, 12)
    corners = [(0.0, 0.0), (float(width), 0.0), (float(width), float(height)), (0.0, float(height))]
    canvas = Canvas(size, corners)
    canvas.polygon(corners)
    canvas.text((width / 2, -0.07 * max(width, height)), str(width), GIVEN)
    canvas.text((-0.08 * max(width, height), height / 2), str(height), GIVEN)
    area, perimeter = width * height, 2 * (width + height)
    if rng.random() < 0.5:
        return Drawn("Find the area of the rectangle.", str(area), f"The area is {width} x {height} = {area}.",
                     canvas.image, [str(perimeter), str(area + width), str(area + height), str(width + height)])
    return Drawn("Find the perimeter of the rectangle.", str(perimeter),
                 f"The perimeter is 2 x ({width} + {height}) = {perimeter}.", canvas.image,
                 [str(area), str(width + height), str(perimeter + 2), str(perimeter - 2)])


def _arc(rng: random.Random, size: int) -> Drawn:
    radius = rng.randint(2, 12)
    angle = rng.choice([30, 40, 45, 60, 72, 80, 90, 100, 120, 135, 150, 160])
    start = rng.randrange(0, 360 - angle)
    O = (0.0, 0.0)
    P = (radius * math.cos(math.radians(start)), radius * math.sin(math.radians(start)))
    Q = (radius * math.cos(math.radians(start + angle)), radius * math.sin(math.radians(start + angle)))
    canvas = Canvas(size, [(-radius, -radius), (radius, radius)], margin=0.1)
    (x0, y0), (x1, y1) = canvas.at((-radius, radius)), canvas.at((radius, -radius))
    canvas.draw.ellipse([x0, y0, x1, y1], outline=INK, width=canvas.width)
    canvas.draw.arc([x0, y0, x1, y1], -(start + angle), -start, fill=ASKED, width=3 * canvas.width)
    canvas.line(O, P)
    canvas.line(O, Q)
    canvas.text(_mul(_add(O, P), 0.5), str(radius), GIVEN)
    canvas.angle_label(O, P, Q, f"{angle}°", GIVEN)
    canvas.text(_mul(P, 1.12), "A")
    canvas.text(_mul(Q, 1.12), "B")
    if rng.random() < 0.5:
        length = Fraction(angle * radius, 180)
        answer = latex_number(length, PI)
        return Drawn("Find the length of the arc AB. Give your answer in terms of \\pi.", answer,
                     f"The arc is {angle}/360 of the circumference 2{PI} x {radius}, so it is {answer}.", canvas.image,
                     [latex_number(length * k, PI) for k in (2, Fraction(1, 2), radius)] + [latex_number(length)])
    area = Fraction(angle * radius * radius, 360)
    answer = latex_number(area, PI)
    return Drawn("Find the area of the sector AOB. Give your answer in terms of \\pi.", answer,
                 f"The sector is {angle}/360 of the disc of area {PI} x {radius}^2, so it is {answer}.", canvas.image,
                 [latex_number(area * k, PI) for k in (2, Fraction(1, 2))] + [latex_number(Fraction(angle * radius, 180), PI)])


MAKERS = {"triangle": _triangle, "isosceles": _isosceles, "parallel": _parallel, "pythagoras": _pythagoras,
          "area": _area, "arc": _arc}


def make_problem(rng: random.Random, image_size: int = 224, kinds: tuple[str, ...] = KINDS,
                 choice_share: float = 0.25) -> Problem:
    """One problem of a kind drawn from `kinds`, its diagram `image_size` pixels square; a share
    `choice_share` of them as multiple choice A-D (the answer is then the letter)."""
    kind = rng.choice(list(kinds))
    drawn = MAKERS[kind](rng, image_size)
    question, answer, solution = drawn.question, drawn.answer, drawn.solution
    if rng.random() < choice_share:
        pool = sorted(set(drawn.wrong) - {answer})
        pool += [str(n) for n in range(1, 10) if str(n) != answer and str(n) not in pool][:max(0, 3 - len(pool))]
        wrong = rng.sample(pool, 3)
        position = rng.randrange(4)
        choices = wrong[:position] + [answer] + wrong[position:]
        question += " Choices: " + " ".join(f"{'ABCD'[i]}: {c}" for i, c in enumerate(choices)) + "."
        solution += f" That is choice {'ABCD'[position]}."
        answer = "ABCD"[position]
    return Problem(f"<image>{question}", answer, solution, drawn.image, kind)
