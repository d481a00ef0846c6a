import os
import sys
import unittest

sys.path.insert(0, os.getcwd())
import calc  # noqa: E402


class HiddenCalcTest(unittest.TestCase):
    def test_add(self):
        self.assertEqual(calc.add(-2, 2), 0)

    def test_divide(self):
        self.assertEqual(calc.divide(1, 4), 0.25)
        self.assertEqual(calc.divide(-9, 3), -3)
        with self.assertRaises(ZeroDivisionError):
            calc.divide(0, 0)

    def test_factorial(self):
        self.assertEqual([calc.factorial(n) for n in range(7)], [1, 1, 2, 6, 24, 120, 720])

    def test_palindrome(self):
        self.assertTrue(calc.is_palindrome("A man a plan a canal Panama"))
        self.assertTrue(calc.is_palindrome("x"))
        self.assertFalse(calc.is_palindrome("ab"))


if __name__ == "__main__":
    unittest.main()
