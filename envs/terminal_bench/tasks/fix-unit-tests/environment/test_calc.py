import unittest

import calc


class CalcTest(unittest.TestCase):
    def test_add(self):
        self.assertEqual(calc.add(2, 3), 5)

    def test_divide(self):
        self.assertEqual(calc.divide(7, 2), 3.5)
        with self.assertRaises(ZeroDivisionError):
            calc.divide(1, 0)

    def test_factorial(self):
        self.assertEqual(calc.factorial(0), 1)
        self.assertEqual(calc.factorial(5), 120)

    def test_palindrome(self):
        self.assertTrue(calc.is_palindrome("Never odd or even"))
        self.assertFalse(calc.is_palindrome("miles agent"))


if __name__ == "__main__":
    unittest.main()
