"""Fixed English text, written for this project (not by any model), that quantized exports are
measured on: the exporter teacher-forces a model over it, and scripts/bench_quality.py over all
of it. Plain prose of several kinds: narrative, explanation, instructions, dialogue."""

TEXT = """\
The harbour town woke slowly in winter. Before the bakery opened its shutters, the fishermen were
already untying their boats, calling to each other across the dark water in voices that carried
further than they meant them to. Mara had lived above the chandler's shop for eleven years, and she
could tell the time by the sounds alone: first the gulls, then the engines, then the bell of the
school on the hill, which rang at half past eight whether or not anyone was ready for it.

That morning the bell did not ring. She noticed the silence the way one notices a missing tooth,
with the tongue before the mind. At nine she walked up the hill with her coat buttoned to the chin
and found the caretaker standing beside the bell tower, staring at a rope that had been cut cleanly
halfway up. "Somebody wanted a quiet morning," he said, and laughed, though he did not look amused.

A computer does not understand a program in the way a person understands a story. It follows
instructions one after another, each of them small: move this number here, add these two values,
compare the result with zero, and jump to another instruction if it is larger. What makes the
machine useful is not the cleverness of any single step but the speed at which it performs millions
of them, and the care with which a programmer arranges them so that the whole sequence does
something worth doing. A spreadsheet that totals a column, a map that finds the shortest road
between two cities, and a game that draws a dragon on the screen are all, underneath, long lists of
such steps.

Memory is the other half of the picture. A processor can only work on numbers it can reach, and the
places it can reach quickly are few. Close to the processor sit tiny caches that answer in a
nanosecond; further away is the main memory, larger and slower; further still are disks and
networks, which may take thousands or millions of times longer to respond. Much of the art of making
software fast is the art of keeping the numbers you need close at hand and not asking for the same
distant thing twice.

To make a simple loaf of bread, mix five hundred grams of flour with ten grams of salt and seven
grams of dried yeast. Add three hundred and fifty millilitres of warm water and stir until no dry
flour remains. Knead the dough on a lightly floured surface for about ten minutes, until it feels
smooth and springs back when pressed. Place it in an oiled bowl, cover it with a cloth, and leave it
somewhere warm until it has doubled in size, which usually takes an hour or a little more. Shape it
into a round, let it rise again for thirty minutes, and bake it in a hot oven for thirty-five minutes.
The loaf is done when it sounds hollow as you tap the bottom.

"Do you think it will rain?" asked the boy, looking at the grey line over the hills.
"It always rains here in the end," his grandmother said. "The only question is whether we finish the
fence first."
"And will we?"
"If you stop asking questions and pass me the hammer, we might."
He passed her the hammer. The first drops fell while she was driving the last nail, and they both
pretended not to notice until the job was done.

Rivers shape the land around them over very long periods of time. A young river in the mountains
runs fast and straight, cutting deep valleys into the rock. As it reaches gentler ground it slows,
begins to wander, and drops the sand and mud it has been carrying. Over centuries these deposits
build wide plains, and the river swings from one side of its valley to the other in slow loops
called meanders. Sometimes a loop is cut off entirely during a flood, leaving behind a curved lake
that gradually fills with reeds and becomes a marsh.

The committee met on the first Tuesday of every month in the back room of the library. There were
seven members, though rarely more than five attended, and the minutes of each meeting were read
aloud at the start of the next one by whoever had remembered to bring them. In March the main item on
the agenda was the roof. It had leaked again over the reference section, and a row of atlases had
been moved to the floor to make room for buckets. Everyone agreed that something had to be done;
nobody agreed on what, or on who would pay for it.

When you learn a new language, the first weeks are full of small victories: ordering coffee,
asking for directions, understanding a sign at the station. Then comes a long middle period in which
progress is hard to see. You know many words but cannot find them quickly, and native speakers seem
to talk at twice the speed of your textbook. The only way through this stage is steady practice.
Read a little every day, listen to the radio even when you understand only a third of it, and do
not be afraid of making mistakes in conversation. People are usually kinder to a learner than the
learner expects.

Late in the evening the storm finally reached the town. The wind pulled at the shutters, the boats
knocked against the harbour wall, and the lights in the windows went out one by one as the power
failed. Mara lit a candle and sat by the window with a cup of tea. Down on the quay she could see
the caretaker again, holding a lantern and walking slowly toward the bell tower. She watched him
for a long time before she understood that he was not alone: a second figure walked beside him,
smaller, carrying a coil of new rope over one shoulder.

In the morning the bell rang at half past eight, a little late, and a little out of tune.
"""
