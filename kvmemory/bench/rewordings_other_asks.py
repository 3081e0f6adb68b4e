"""The "other asks" check: the same situation with the same numbers as a stored problem, asking for a
different quantity, so that the stored answer is wrong for it.

Written by hand on 2026-12-05 by a different author than the two rewordings sets
(`rewordings_calibration.py` and `rewordings_heldout.py`), before any figure was measured with it.

Each entry is a tuple (index, question, answer):
    index    -- the index of a stored problem in the set's `PROBLEMS`
    question -- the stored problem's situation with exactly the numbers it writes (written as digits the
                same way, none added; a natural rephrasing), asking for another quantity: a quantity the
                stored solution writes as an intermediate result (the total before a subtraction, the
                cost of one part), or one simple to compute from the same numbers
    answer   -- the correct answer to the question, a plain number as a string; never the stored answer

CALIBRATION holds one entry for each of the 40 problems of `rewordings_calibration.PROBLEMS` (index
0..39, in order) and may be used to calibrate. REPORT holds one entry for each of the 40 problems of
`rewordings_heldout.PROBLEMS` and is held out: nothing may be calibrated or tuned on it.

A change to this file after figures exist must be said in BENCHMARKS.md (it would no longer be held out).
"""

from __future__ import annotations

# (index into rewordings_calibration.PROBLEMS, question, correct answer)
CALIBRATION: list[tuple[int, str, str]] = [
    (0, "A bakery bakes 24 muffins per tray and fills 5 trays. It sells 87 muffins. "
        "How many muffins did it bake before selling any?", "120"),
    (1, "A car travels at 60 km per hour for 3 hours and then at 80 km per hour for 2 hours. "
        "What is its average speed in km per hour over the whole trip?", "68"),
    (2, "Apples cost $2 per pound. Maria buys 4 pounds of apples and a loaf of bread for $3. "
        "How many dollars more does she spend on apples than on bread?", "5"),
    (3, "A rectangular garden is 12 meters long and 7 meters wide. What is its perimeter in meters?", "38"),
    (4, "The temperature in the morning is 8 degrees Celsius. By noon it rises 9 degrees, and by night it "
        "falls 13 degrees. What is the temperature at noon in degrees Celsius?", "17"),
    (5, "A jacket costs $80 and is on sale for 25% off. How many dollars does a buyer save with the sale?",
     "20"),
    (6, "Sam reads 15 pages a day. His book has 240 pages. How many pages are still unread after a week?",
     "135"),
    (7, "A pizza is cut into 8 slices. A family orders 3 pizzas and eats 19 slices. "
        "How many slices were there before they started eating?", "24"),
    (8, "A tank holds 1200 liters of water. A pump removes 75 liters per minute. "
        "How many liters does the pump remove in an hour?", "4500"),
    (9, "Lena scored 78, 85 and 92 on three tests. What is her total score over the three tests?", "255"),
    (10, "Tom earns $15 per hour. He works 6 hours on Monday and 8 hours on Tuesday. "
         "How many dollars more does he earn on Tuesday than on Monday?", "30"),
    (11, "A car uses 6 liters of fuel per 100 kilometers. How many liters does it use for a round trip "
         "of 350 kilometers each way?", "42"),
    (12, "Emma bakes 36 cookies and shares them equally among herself and 5 friends. "
         "How many cookies do her friends get altogether?", "30"),
    (13, "A phone plan costs $20 per month plus $0.10 per text message. Jay sends 150 texts in a month. "
         "How much do his text messages cost in dollars?", "15"),
    (14, "Ana walks 2.5 kilometers each day for 2 weeks. How many kilometers does she walk in each week?",
     "17.5"),
    (15, "One can of paint covers 12 square meters. A wall is 6 meters long and 4 meters high. "
         "What is the area of the wall in square meters?", "24"),
    (16, "Movie tickets cost $12 for adults and $8 for children. 2 adults and 3 children go to the movies. "
         "How many dollars do the children's tickets cost?", "24"),
    (17, "A recipe uses 3 eggs to make 12 pancakes. How many batches of the recipe are needed "
         "to make 36 pancakes?", "3"),
    (18, "Priya saves $25 each week. She already has $40. How many dollars does she save during "
         "the next 8 weeks, not counting what she already has?", "200"),
    (19, "A school bus has 12 rows of 4 seats. 35 students are on the bus. "
         "How many seats does the bus have in all?", "48"),
    (20, "A heater uses 1.5 kilowatts. Electricity costs $0.20 per kilowatt-hour. "
         "How many kilowatt-hours does the heater use in 4 hours?", "6"),
    (21, "A square yard has sides of 15 meters. What is the area of the yard in square meters?", "225"),
    (22, "A runner runs laps of 400 meters on a track. She runs 12 laps. How many meters does she run?",
     "4800"),
    (23, "Mia is 3 times as old as her brother. Her brother is 4 years old. "
         "How old will her brother be in 5 years?", "9"),
    (24, "Leo buys 2 coffees at $3.50 each and pays with a $10 bill. "
         "How much do the coffees cost together in dollars?", "7"),
    (25, "A plant is 14 centimeters tall and grows 3 centimeters each week. "
         "How many centimeters does it grow over 6 weeks?", "18"),
    (26, "Washing a load of laundry takes 45 minutes and drying it takes 60 minutes. 4 loads are washed "
         "and dried one after another. How many minutes do the loads spend in the washer in total?", "180"),
    (27, "Kim buys 5 packs of balloons with 20 balloons in each pack and divides them equally among "
         "4 party tables. How many balloons does she buy in total?", "100"),
    (28, "A dinner bill is $60. Chris leaves a 15% tip. How much is the tip in dollars?", "9"),
    (29, "Nora cycles 45 kilometers in 3 hours. On average, how many minutes does she take "
         "per kilometer?", "4"),
    (30, "A teacher has 150 pencils and gives 4 pencils to each of 28 students. "
         "How many pencils does she give out in total?", "112"),
    (31, "It rained 12 millimeters on Monday, 7 millimeters on Tuesday and 20 millimeters on Wednesday. "
         "What was the total rainfall over those days in millimeters?", "39"),
    (32, "A 6-pack of juice costs $4.80. What is the price of half a pack in dollars?", "2.4"),
    (33, "A farmer plants 8 rows of tomatoes with 15 plants in each row. Each plant gives 4 kilograms "
         "of tomatoes. How many kilograms of tomatoes does each row give?", "60"),
    (34, "Ben sleeps from 10 pm to 6:30 am every night for 5 nights. How many hours does he sleep "
         "each night?", "8.5"),
    (35, "One euro is worth 1.1 US dollars. You change 250 euros into US dollars. "
         "How many more dollars than euros is that?", "25"),
    (36, "Each step on a staircase is 18 centimeters high. A floor is 3.6 meters high. "
         "How high is the floor in centimeters?", "360"),
    (37, "A dog eats 300 grams of food a day. A bag of dog food holds 9 kilograms. "
         "How many grams of food are in the bag?", "9000"),
    (38, "A class has 32 students. 1/4 of them walk to school and the rest take the bus. "
         "How many students walk to school?", "8"),
    (39, "A hotel room costs $95 per night. A family stays 4 nights and pays a $30 cleaning fee. "
         "What is the average cost per night in dollars, cleaning fee included?", "102.5"),
]

# (index into rewordings_heldout.PROBLEMS, question, correct answer)
REPORT: list[tuple[int, str, str]] = [
    (0, "A baker makes 24 muffins and sells 18 of them. How many more muffins are sold than are left?",
     "12"),
    (1, "A train travels at 80 km per hour for 3 hours. How many minutes does the trip last?", "180"),
    (2, "Maria buys 4 notebooks at $3 each and a pen for $2. How much does she spend on the notebooks?",
     "12"),
    (3, "A rectangle is 7 cm long and 5 cm wide. What is its perimeter in cm?", "24"),
    (4, "Tom reads 15 pages a day for 12 days. How many pages does he read in a week?", "105"),
    (5, "A farmer has 36 eggs and packs them in cartons of 6. How many dozen eggs does he have?", "3"),
    (6, "A shirt costs $40 and is on sale for 25% off. How much money does a buyer save?", "10"),
    (7, "Sam has 3 times as many marbles as Ann. Ann has 14 marbles. "
        "How many marbles do Sam and Ann have together?", "56"),
    (8, "A tank holds 500 liters of water. 125 liters leak out. What percent of the water leaks out?", "25"),
    (9, "A class has 28 students. Each student needs 2 pencils. "
        "How many pencils do half of the students need?", "28"),
    (10, "A car uses 6 liters of fuel per 100 km. How much fuel does it use for a round trip "
         "of 450 km each way?", "54"),
    (11, "Lena saves $15 every week and wants to reach $180. If she saved twice as much each week, "
         "how many weeks would she need?", "6"),
    (12, "A garden has 8 rows of 12 tomato plants. How many tomato plants are in half of the rows?", "48"),
    (13, "A pool is filled at 40 liters per minute, up to 1200 liters. "
         "How many liters flow into it in an hour?", "2400"),
    (14, "Jake ran 5 km on Monday, 7 km on Tuesday and 9 km on Wednesday. "
         "How many more km did he run on Wednesday than on Monday?", "4"),
    (15, "A box of 12 chocolates costs $9. How much does half a box cost?", "4.5"),
    (16, "A school bus carries 45 students. There are 180 students. "
         "How many students still need a ride after the first bus leaves full?", "135"),
    (17, "Nina is 12 years old. Her father is 3 times her age. How much older than Nina is her father?",
     "24"),
    (18, "A phone battery drops 8% per hour. It starts full and drops 64%. What percent is left?", "36"),
    (19, "A recipe uses 3 cups of flour for 24 cookies. How many batches of the recipe "
         "are needed for 72 cookies?", "3"),
    (20, "A bike costs $240. Paul pays $60 now and the rest in 4 equal payments. "
         "How much does he still owe after paying now?", "180"),
    (21, "A square has a side of 9 m. What is its area in square meters?", "81"),
    (22, "A printer prints 30 pages per minute and runs for 15 minutes. "
         "How many seconds does each page take?", "2"),
    (23, "Emma had 50 stickers. She gave 12 to her brother and 9 to her sister. "
         "How many stickers did she give away in total?", "21"),
    (24, "A hotel room costs $85 per night. We booked 4 nights. How much would a full week cost instead?",
     "595"),
    (25, "A water bottle holds 750 ml. Bottles are filled from 6 liters. "
         "How many milliliters is that?", "6000"),
    (26, "A worker earns $18 per hour and works 40 hours a week. "
         "How much does the worker earn over a fortnight?", "1440"),
    (27, "A pizza is cut into 8 slices. 4 friends share it equally. If they order a second pizza "
         "just like it, how many slices does each friend get in all?", "4"),
    (28, "A library has 1250 books. It buys 375 more. By what percent does its collection grow?", "30"),
    (29, "A runner completes a lap in 90 seconds and runs 6 laps. "
         "How many laps could she complete in an hour at that pace?", "40"),
    (30, "A store sells apples at 3 for $2. Someone wants 15 apples. "
         "How many of those deals is that?", "5"),
    (31, "The temperature was -4 degrees in the morning and rose by 11 degrees by noon. If it rises by "
         "the same amount again in the afternoon, what will the temperature be then?", "18"),
    (32, "A cyclist rides 60 km in 2.5 hours. At that speed, how many km does she ride in half an hour?",
     "12"),
    (33, "A family drinks 2 liters of milk a day for 3 weeks. How many liters do they drink per week?",
     "14"),
    (34, "A ticket costs $12 for adults and $7 for children. 2 adult and 3 child tickets are bought. "
         "How much do the child tickets cost?", "21"),
    (35, "A field is 120 m long and 80 m wide. What is its area in square meters?", "9600"),
    (36, "Kate types 55 words per minute for 20 minutes. "
         "How many words would she type if she kept going for a full hour?", "3300"),
    (37, "A jar has 200 candies and 35% of them are red. How many candies are not red?", "130"),
    (38, "A plane flies 900 km in 1.5 hours and then flies for 4 hours at the same speed. "
         "What is its speed in km per hour?", "600"),
    (39, "Ben has 7 boxes with 16 crayons each. He loses 10 crayons. "
         "How many crayons did he have before losing any?", "112"),
]
