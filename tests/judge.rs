//! The judge on its own: cases built so their answer is known, for every rule that decides a
//! verdict.
