"""Print the median of the numbers in a file (one per line)."""
import sys


def median(values):
    n = len(values)
    mid = n // 2
    return values[mid]


def main():
    with open(sys.argv[1]) as f:
        values = [float(line) for line in f if line.strip()]
    print(f"{median(values):g}")


if __name__ == "__main__":
    main()
