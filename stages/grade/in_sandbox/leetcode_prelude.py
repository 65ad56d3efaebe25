"""What a LeetCode solution expects to find without importing it.

The functional harness (:mod:`stages.grade.in_sandbox.leetcode_harness`) runs
this file's source in the solution's globals before the solution: the usual
star imports of the judge, ``inf``, the ``ListNode`` and ``TreeNode`` classes,
and the helpers the data sets' ``check()`` functions call: ``list_node`` and
``tree_node`` build a linked list or a tree from a list (trees in level order,
``None`` for a missing child), ``is_same_list`` and ``is_same_tree`` compare
them by value. The grader never trusts these in the program: it decodes each
returned value and compares it in its own process
(:mod:`stages.grade.functional`).
"""

# The judge's environment: wildcard imports whose order decides a clash (``Counter`` is
# collections', not typing's), then the modules themselves by name.
# isort: off
from typing import *  # noqa: F403
from collections import *  # noqa: F403
from itertools import *  # noqa: F403
from functools import *  # noqa: F403
from heapq import *  # noqa: F403
from bisect import *  # noqa: F403
from math import *  # noqa: F403
import math, heapq, bisect, itertools, functools, collections, string, re, random, operator  # noqa: E401, F401
# isort: on

inf = float("inf")


class ListNode:
    def __init__(self, val=0, next=None):
        self.val = val
        self.next = next


class TreeNode:
    def __init__(self, val=0, left=None, right=None):
        self.val = val
        self.left = left
        self.right = right


def list_node(values):
    head = cur = ListNode()
    for v in values:
        cur.next = ListNode(v)
        cur = cur.next
    return head.next


def is_same_list(a, b):
    while a and b:
        if a.val != b.val:
            return False
        a, b = a.next, b.next
    return a is None and b is None


def tree_node(values):
    if not values:
        return None
    root = TreeNode(values[0])
    q, i = collections.deque([root]), 1
    while q and i < len(values):
        node = q.popleft()
        if i < len(values) and values[i] is not None:
            node.left = TreeNode(values[i])
            q.append(node.left)
        i += 1
        if i < len(values) and values[i] is not None:
            node.right = TreeNode(values[i])
            q.append(node.right)
        i += 1
    return root


def is_same_tree(a, b):
    if a is None or b is None:
        return a is b
    return a.val == b.val and is_same_tree(a.left, b.left) and is_same_tree(a.right, b.right)
