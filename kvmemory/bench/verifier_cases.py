"""Hand-written worked solutions for the verifier bench, each with its wrong-answer twins.

Written for this bench, in the styles people write solutions in (not GSM8K's "#### N"): conclusions
in a sentence or a clause ("so 12 cows", "Largest is 32"), units, currency, percent, area, thousands
separators, decimals, fractions and mixed numbers, a negative number, a number in words, "Answer:",
"\\boxed{}". The first two are the shapes of the two correct solutions issue 41 reports refused.

Each case has two twins that must be refused: `wrong_solution`, the same working with another
conclusion (often a number the working wrote earlier, so that "the answer appears somewhere" does not
pass), checked against the right `answer`; and `wrong_answer`, another expected answer (a number of
the working) checked against the right solution. Nothing here was tuned on the verifier's output: a
case the verifier gets wrong stays in and is counted.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HandCase", "HAND_CASES", "HELDOUT_CASES"]


@dataclass(frozen=True, slots=True)
class HandCase:
    problem: str
    solution: str
    answer: str
    wrong_solution: str  # the same working, another conclusion
    wrong_answer: str  # another expected answer, for `solution`


HAND_CASES: tuple[HandCase, ...] = (
    HandCase(
        "The sum of three consecutive integers is 93. What is the largest of them?",
        "Middle integer = 93 / 3 = 31, so they are 30, 31, 32. Largest is 32.",
        "32",
        "Middle integer = 93 / 3 = 31, so they are 30, 31, 32. Smallest is 30.",
        "31"),
    HandCase(
        "A farm has 12 animals, chickens and cows, with 48 legs in all. How many cows are there?",
        "If all 12 were chickens there would be 12 * 2 = 24 legs. There are 48 - 24 = 24 extra legs, and "
        "each cow adds 2, so 12 cows.",
        "12",
        "If all 12 were chickens there would be 12 * 2 = 24 legs. There are 48 - 24 = 24 extra legs, and "
        "each cow adds 2, so 24 cows.",
        "24"),
    HandCase(
        "A laptop costs $1,000 and a case costs $250. What do both cost together?",
        "The laptop is $1,000 and the case is $250, so together they cost $1,250.00.",
        "1250",
        "The laptop is $1,000 and the case is $250, so together they cost $1,000.",
        "250"),
    HandCase(
        "Mia walks 1.5 km to the park and 2 km to school. How far does she walk?",
        "1.5 + 2 = 3.5. She walks 3.5 km.",
        "3.5 km",
        "1.5 + 2 = 3.5. She walks 2 km.",
        "1.5"),
    HandCase(
        "A class of 40 has 18 students who bike to school. What percent bike?",
        "18 / 40 = 0.45, and 0.45 * 100 = 45. So 45% of the class bikes.",
        "45%",
        "18 / 40 = 0.45, and 0.45 * 100 = 45. So 40% of the class bikes.",
        "18"),
    HandCase(
        "A rectangle is 4 cm wide and 7 cm long. What is its area?",
        "Area is width times length: 4 * 7 = 28, so the area is 28 cm^2.",
        "28",
        "Area is width times length: 4 * 7 = 28, so the perimeter is 22 cm.",
        "7"),
    HandCase(
        "A pizza has 8 slices and Ben eats 6. What fraction of the pizza did he eat?",
        "He ate 6 of 8 slices, which is 6/8 = 3/4 of the pizza.",
        "0.75",
        "He ate 6 of 8 slices, so 2/8 = 1/4 of the pizza is left.",
        "6"),
    HandCase(
        "A recipe needs 3/4 cup of sugar per batch. How much sugar do 2 batches need?",
        "Two batches need 2 * 3/4 = 6/4 cups. That is 1 1/2 cups of sugar.",
        "3/2",
        "Two batches need 2 * 3/4 = 6/4 cups. That is 1 1/4 cups of sugar.",
        "2"),
    HandCase(
        "The temperature was 7 degrees at noon and fell 12 degrees by midnight. What was it at midnight?",
        "It fell from 7 by 12 degrees: 7 - 12 = -5. At midnight it was -5 degrees.",
        "-5",
        "It fell from 7 by 12 degrees: 7 - 12 = -5. At midnight it was 5 degrees.",
        "12"),
    HandCase(
        "Sam has 3 bags of 4 apples. How many apples does he have?",
        "Three bags of four apples each give 3 * 4 = 12 apples, so Sam has twelve.",
        "12",
        "Three bags of four apples each give 3 * 4 = 12 apples, so Sam has seven.",
        "4"),
    HandCase(
        "A town of 9,800 people grows by 2,700. How many people live there now?",
        "9,800 + 2,700 = 12,500.\nAnswer: 12,500 people",
        "12500",
        "9,800 + 2,700 = 12,500.\nAnswer: 9,800 people",
        "2700"),
    HandCase(
        "Ana buys 3 books at $7 each and a pen for $2. How much does she spend?",
        "The books cost 3 * 7 = 21 dollars. Adding the pen, 21 + 2 = 23. The answer is \\boxed{23}.",
        "23",
        "The books cost 3 * 7 = 21 dollars. Adding the pen, 21 + 2 = 23. The answer is \\boxed{21}.",
        "21"),
    HandCase(
        "Lily baked 36 cookies and gave 5 to each of her 6 friends. How many cookies does she have left?",
        "She gave away 5 * 6 = 30 cookies. That leaves 36 - 30 = 6 cookies for Lily.",
        "6",
        "She gave away 5 * 6 = 30 cookies. That leaves 30 cookies for Lily.",
        "30"),
    HandCase(
        "A train travels 150 km at 60 km per hour. How long does the trip take?",
        "Time is distance over speed: 150 / 60 = 2.5. The trip takes 2.5 hours.",
        "2.5",
        "Time is distance over speed: 150 / 60 = 2.5. The trip takes 60 minutes.",
        "150"),
    HandCase(
        "Priya saves $12 a week for 7 weeks and then spends $37.50 on shoes. How much is left?",
        "After 7 weeks she has saved 12 * 7 = 84 dollars. After the shoes, she has $46.50 left.",
        "46.50",
        "After 7 weeks she has saved 12 * 7 = 84 dollars. After the shoes, she has $84 left.",
        "84"),
    HandCase(
        "4 friends share 28 stickers equally. How many does each get?",
        "28 / 4 = 7, so each of the 4 friends gets 7 stickers.",
        "7",
        "28 / 4 = 7, so each of the 4 friends gets 28 stickers.",
        "4"),
    HandCase(
        "Tom is 3 years older than Ann, who is 11. How old is Tom?",
        "Ann is 11, and 11 + 3 = 14. Therefore, Tom is 14 years old.",
        "14",
        "Ann is 11, and 11 + 3 = 14. Therefore, Tom is 11 years old.",
        "11"),
    HandCase(
        "A tank holds 500 liters and is filled at 20 liters per minute. How many minutes to fill it?",
        "500 / 20 = 25\nIt takes 25 minutes to fill the tank.\nCheck: 25 * 20 = 500 liters.",
        "25",
        "500 / 20 = 25\nIt takes 20 minutes to fill the tank.\nCheck: 25 * 20 = 500 liters.",
        "500"),
    HandCase(
        "Jo reads 15 pages a day. How many pages does she read in 2 weeks?",
        "Two weeks are 14 days. In 14 days she reads 14 * 15 = 210 pages.",
        "210",
        "Two weeks are 14 days. In 14 days she reads 14 * 15 = 210 pages, so 200 pages.",
        "14"),
    HandCase(
        "A shirt costs $40 and is 25% off. What is the sale price?",
        "The discount is 25% of $40, which is $10. So the shirt now costs $30.",
        "30",
        "The discount is 25% of $40, which is $10. So the shirt now costs $40.",
        "10"),
)

# Written after the verifier was finished and measured once, as a check nobody tuned on: BENCHMARKS.md
# reports this set's first run; a fix made after it is named there.
HELDOUT_CASES: tuple[HandCase, ...] = (
    HandCase(
        "Kim has 45 marbles and gives a third of them to Joe. How many does she keep?",
        "A third of 45 is 15, which she gives away. She keeps the other 30 marbles.",
        "30",
        "A third of 45 is 15, which she gives away. She keeps the other 15 marbles.",
        "15"),
    HandCase(
        "A bus leaves at 8:15 and the ride takes 45 minutes. How many minutes after 8:00 does it arrive?",
        "It leaves 15 minutes after 8:00 and rides 45 more, so it arrives 15 + 45 = 60 minutes after 8:00.",
        "60",
        "It leaves 15 minutes after 8:00 and rides 45 more, so it arrives 45 minutes after 8:00.",
        "45"),
    HandCase(
        "Oranges cost $0.40 each. How much do 15 oranges cost?",
        "15 x $0.40 = $6.00\n\nTotal cost: $6",
        "6",
        "15 x $0.40 = $6.00\n\nTotal cost: $0.40",
        "15"),
    HandCase(
        "A garden is 12 m by 9 m. A path takes 18 square meters of it. How much area is left for plants?",
        "Whole garden: 12 × 9 = 108 m². Minus the path: 108 − 18 = 90 m² for plants.",
        "90",
        "Whole garden: 12 × 9 = 108 m². Minus the path: 108 − 18 = 108 m² for plants.",
        "108"),
    HandCase(
        "Raj scored 78, 85 and 92 on three tests. What is his average?",
        "Sum: 78 + 85 + 92 = 255. Average = 255 / 3 = 85.\n\n**Answer: 85**",
        "85",
        "Sum: 78 + 85 + 92 = 255. Average = 255 / 3 = 85.\n\n**Answer: 92**",
        "255"),
    HandCase(
        "A jar has 3 red, 5 blue and 2 green beads. What fraction of the beads are blue?",
        "There are 3 + 5 + 2 = 10 beads and 5 are blue, so the fraction is 5/10, or 1/2.",
        "1/2",
        "There are 3 + 5 + 2 = 10 beads and 5 are blue, so the fraction is 3/10.",
        "5"),
    HandCase(
        "Leo runs 4 laps of a 400 m track. How many kilometres does he run?",
        "4 laps × 400 m = 1,600 m, which is 1.6 km.",
        "1.6",
        "4 laps × 400 m = 1,600 m, which is 16 km.",
        "1600"),
    HandCase(
        "A store had 120 shirts, sold 45 on Monday and 38 on Tuesday. How many are left?",
        "Sold in total: 45 + 38 = 83.\nLeft: 120 - 83 = 37\nSo the store has 37 shirts left.",
        "37",
        "Sold in total: 45 + 38 = 83.\nLeft: 120 - 83 = 37\nSo the store has 83 shirts left.",
        "83"),
    HandCase(
        "Nina is twice as old as her brother, who is 7. How old will Nina be in 5 years?",
        "Nina is 2 * 7 = 14 now. In 5 years she will be 19.",
        "19",
        "Nina is 2 * 7 = 14 now. In 5 years she will be 14.",
        "14"),
    HandCase(
        "A submarine is 40 m below sea level and dives another 25 m. What is its depth relative to sea level?",
        "Starting at -40 m and going down 25 m more gives -40 - 25 = -65. It is at -65 m.",
        "-65",
        "Starting at -40 m and going down 25 m more gives -40 - 25 = -65. It is at -40 m.",
        "25"),
    HandCase(
        "Eggs come in cartons of 12. How many cartons are needed for 150 eggs?",
        "150 / 12 = 12.5, and half a carton is not enough, so we need 13 cartons.",
        "13",
        "150 / 12 = 12.5, and half a carton is not enough, so we need 12 cartons.",
        "12.5"),
    HandCase(
        "A phone costs $480 and is discounted by 15%. What is the discount in dollars?",
        "15% of 480 = 0.15 * 480 = 72\nThe discount is $72.",
        "72",
        "15% of 480 = 0.15 * 480 = 72\nThe discount is $408.",
        "480"),
    HandCase(
        "Three friends split a bill of $96 equally. How much does each pay?",
        "Each friend pays $96 ÷ 3 = $32.",
        "32",
        "Each friend pays $96 ÷ 3 = $96.",
        "3"),
    HandCase(
        "A bakery makes 8 dozen rolls. How many rolls is that?",
        "One dozen is 12 rolls, so eight dozen is 8 * 12 = 96 rolls.",
        "96",
        "One dozen is 12 rolls, so eight dozen is 8 * 12 = 84 rolls.",
        "12"),
    HandCase(
        "Water fills a 2.5 litre bottle in 10 seconds. How many litres per second is that?",
        "Rate = 2.5 / 10 = 0.25 litres per second.",
        "0.25",
        "Rate = 2.5 / 10 = 0.5 litres per second.",
        "2.5"),
    HandCase(
        "A library had 2,340 books and received 1,275 more. How many books does it have now?",
        "2,340 + 1,275 = 3,615\n\nThe library now has three thousand six hundred fifteen books, i.e. 3,615.",
        "3615",
        "2,340 + 1,275 = 3,615\n\nThe library now has 2,340 books.",
        "1275"),
    HandCase(
        "Sara earns $15 an hour and works 6 hours a day for 5 days. How much does she earn?",
        "Per day: 15 * 6 = 90 dollars. For 5 days: 90 * 5 = 450 dollars.\nShe earns $450 in total.",
        "450",
        "Per day: 15 * 6 = 90 dollars. For 5 days: 90 * 5 = 450 dollars.\nShe earns $90 in total.",
        "90"),
    HandCase(
        "A rope 7.2 m long is cut into 4 equal pieces. How long is each piece?",
        "7.2 / 4 = 1.8\nEach piece is 1.8 m long.",
        "1.8 m",
        "7.2 / 4 = 1.8\nEach piece is 7.2 m long.",
        "4"),
    HandCase(
        "There are 5 rows of 6 chairs and 4 chairs are broken. How many chairs can be used?",
        "5 rows of 6 chairs make 30 chairs. Without the 4 broken ones, 26 chairs can be used.",
        "26",
        "5 rows of 6 chairs make 30 chairs. Without the 4 broken ones, 30 chairs can be used.",
        "30"),
    HandCase(
        "Ella had 50 stickers, gave 12 to Max and got 7 from Zoe. How many stickers does she have?",
        "50 − 12 = 38, then 38 + 7 = 45.\n\nElla ends up with 45 stickers.",
        "45",
        "50 − 12 = 38, then 38 + 7 = 45.\n\nElla ends up with 38 stickers.",
        "38"),
)
