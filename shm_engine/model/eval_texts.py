"""Fixed texts for measuring the int8 model's accuracy against fp32 (teacher-forced top-1
agreement, perplexity): the model tests use the first, scripts/act_quant_study.py all of them.
CALIBRATION_TEXT is never evaluated: activation statistics for smoothing come from it."""

EVAL_TEXTS = (
    "The history of computing is longer than the history of computing hardware and modern "
    "computing technology and includes the history of methods intended for pen and paper or for "
    "chalk and slate, with or without the aid of tables. Digital computing is intimately tied to "
    "the representation of numbers. But long before abstractions like the number arose, there "
    "were mathematical concepts to serve the purposes of civilization. These concepts are "
    "implicit in concrete practices such as one-to-one correspondence, the basis of counting, "
    "and comparison to a standard, used for measurement. The earliest known tool for use in "
    "computation was the abacus, and it was thought to have been invented in Babylon circa "
    "2400 BC. Its original style of usage was by lines drawn in sand with pebbles. Abaci, of a "
    "more modern design, are still used as calculation tools today.",
    "To make a simple loaf of bread, mix five hundred grams of flour with ten grams of salt and "
    "seven grams of dried yeast. Add about three hundred and fifty millilitres of warm water and "
    "stir until a rough dough forms. Knead it on a floured surface for ten minutes, until it is "
    "smooth and springs back when pressed. Leave it in a covered bowl in a warm place for an hour, "
    "or until it has doubled in size. Shape it into a loaf, place it in a tin, and let it rise "
    "again for thirty minutes. Bake at two hundred degrees for thirty to thirty-five minutes, "
    "until the crust is golden and the loaf sounds hollow when tapped underneath.",
    "The city council met on Thursday evening to discuss the new bus routes. Several residents "
    "complained that the changes would leave older people without a direct service to the "
    "hospital, while others welcomed the more frequent buses on the main roads. The transport "
    "officer explained that the budget had been cut by a fifth and that the network had to be "
    "simplified. After a long debate, the council agreed to keep the hospital route for another "
    "year and to review the whole network next spring, once the first figures on passenger "
    "numbers are available.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n"
    "        if not self.items:\n            raise IndexError('pop from an empty stack')\n"
    "        return self.items.pop()\n\n    def __len__(self):\n        return len(self.items)\n",
)
CALIBRATION_TEXT = (
    "Photosynthesis is the process by which green plants and some other organisms use sunlight "
    "to synthesize foods from carbon dioxide and water. It generally involves the green pigment "
    "chlorophyll and generates oxygen as a byproduct. The rivers of the northern plains flooded "
    "every spring, and the farmers who lived along their banks learned to read the weather. "
    "In 1969 the first humans walked on the Moon; the mission lasted eight days. Markets rose "
    "sharply on Tuesday after the central bank held interest rates steady, while bond yields fell."
)
